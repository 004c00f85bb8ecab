"""Chunk kinds: what each kind of chunk holds, where it may live and how it moves, declared once.

A chunk's kind follows from its parameters (``ChunkLayout.kind``): a chunk of parameters that train
is ``TRAINABLE``, a chunk of parameters with ``requires_grad=False`` (a LoRA run's base) is
``FROZEN``; the layout packs the two apart, so a chunk is one or the other. Every place that treats
chunks differently by kind asks the kind, not the layout's extents or a parameter's flag:

    kind.master / kind.moments    it has an fp32 master / Adam's two moments (its optimizer states)
    kind.grad                     the backward gives it a gradient (stored, accumulated, reduced)
    kind.updated                  the optimizer updates it (so its compute copy is rewritten)
    kind.tiers                    where its home may be: a chunk of another kind is not homed there
    kind.state_bytes              bytes per element of its optimizer states (the master + moments)

    TRAINABLE   compute copy + fp32 master + two fp32 moments; gradient; updated;
                home on the host, the disk or (when the host cannot hold it) the device
    FROZEN      compute copy only; no gradient, never updated, never written back;
                home on the host or the disk (the device holds it only while a step reads it)

A new kind (issue 72's 4-bit frozen base) is a new declaration here, and ``ChunkLayout.kind``
saying which chunks have it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pscompile.memory.tiers import Tier

__all__ = ["ChunkKind", "TRAINABLE", "FROZEN", "KINDS"]

_FP32 = 4


@dataclass(frozen=True)
class ChunkKind:
    """One kind of chunk (see the module doc)."""

    name: str
    master: bool               # an fp32 master copy, the optimizer's
    moments: bool              # Adam's exp_avg and exp_avg_sq, fp32
    grad: bool                 # the backward writes it a gradient
    tiers: frozenset[Tier]     # where its home may be

    @property
    def updated(self) -> bool:
        """The optimizer updates it, so its compute copy changes (a device home is written back)."""
        return self.master

    @property
    def has_states(self) -> bool:
        """It has optimizer states to place (on the device, the host or the disk)."""
        return self.master or self.moments

    @property
    def state_bytes(self) -> int:
        """Bytes per element of its optimizer states."""
        return _FP32 * (int(self.master) + 2 * int(self.moments))

    def homed_on(self, tier: Tier) -> bool:
        return tier in self.tiers

    def __str__(self) -> str:
        return self.name


TRAINABLE = ChunkKind("trainable", master=True, moments=True, grad=True,
                      tiers=frozenset({Tier.HOST, Tier.DISK, Tier.DEVICE}))
FROZEN = ChunkKind("frozen", master=False, moments=False, grad=False, tiers=frozenset({Tier.HOST, Tier.DISK}))

KINDS = (TRAINABLE, FROZEN)
