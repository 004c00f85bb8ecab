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
    FROZEN_NF4  a FROZEN chunk kept in NF4 (``Config(frozen_format="nf4")``, ``memory/nf4.py``): 4
                bits a weight and a float32 absmax per block of 64 at home and over the link; on
                the device dequantized to the compute dtype in its slot as its fetch lands; home on
                the host or the disk (its packed bytes there too)

    kind.format                   how its compute copy is kept at home and moved: "compute" (the
                                  compute dtype) or "nf4"; ``home_bytes`` gives its bytes

A new kind is a new declaration here, and ``ChunkLayout.kind`` saying which chunks have it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pscompile.memory import nf4
from pscompile.memory.tiers import Tier

__all__ = ["ChunkKind", "TRAINABLE", "FROZEN", "FROZEN_NF4", "KINDS", "FORMATS"]

FORMATS = ("nf4",)          # the formats a frozen base may be kept in besides the compute dtype

_FP32 = 4


@dataclass(frozen=True)
class ChunkKind:
    """One kind of chunk (see the module doc)."""

    name: str
    master: bool               # an fp32 master copy, the optimizer's
    moments: bool              # Adam's exp_avg and exp_avg_sq, fp32
    grad: bool                 # the backward writes it a gradient
    tiers: frozenset[Tier]     # where its home may be
    format: str = "compute"    # its compute copy at home and over the link: "compute" or "nf4"

    @property
    def packed(self) -> bool:
        """Kept in NF4: its home and its fetches are packed bytes (``uint8``), not compute-dtype elements."""
        return self.format == "nf4"

    def home_bytes(self, numel: int, elsize: int) -> int:
        """Bytes of ``numel`` elements of its compute copy at home and over the link (``elsize``:
        the compute dtype's)."""
        return nf4.packed_bytes(numel) if self.packed else numel * elsize

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

FROZEN_NF4 = ChunkKind("frozen-nf4", master=False, moments=False, grad=False, tiers=frozenset({Tier.HOST, Tier.DISK}),
                       format="nf4")

KINDS = (TRAINABLE, FROZEN, FROZEN_NF4)
