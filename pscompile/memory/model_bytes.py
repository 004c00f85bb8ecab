"""How many bytes model data takes: one answer for every caller (the engine's host check, the
minimum budget, the placement rule, the planner).

Model data per parameter element: its compute-dtype copy (``param_bytes``, the chunk a step reads)
and its optimizer states, an fp32 master and Adam's two moments (``STATE_BYTES`` = 3 x 4). A chunk
of ``chunk_size`` elements is one of each. Lock-free updating (``Config(lock_free=True)``) adds on
the host a second compute-dtype copy (the next parameters, written by the update thread) and
``staleness + 1`` fp32 gradient buffer sets.

What a chunk holds besides its compute-dtype copy is its kind's (``ChunkLayout.kind``,
``memory/chunk_kinds.py``): a frozen chunk is its compute-dtype copy alone, and a trainable chunk's
states (``ChunkKind.state_bytes`` per element) cover its state extent (``ChunkLayout.state_extent``):
``host_bytes`` counts both. A chunk kept in NF4 (``FROZEN_NF4``) is its packed bytes at home and over
the link (``fetch_bytes``); its slot on the device is a compute-dtype chunk like any other, and
landing a fetch takes a workspace beside it (``dequant_workspace``), counted with the device's fixed
bytes by every caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from pscompile.memory import nf4
from pscompile.memory.chunk_kinds import TRAINABLE
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.tiers import Tier

# fp32 master + exp_avg + exp_avg_sq, per element
STATE_BYTES = TRAINABLE.state_bytes       # 3 x 4
# fp32 gradient accumulation (and lock-free gradient buffers), per element
GRAD_BYTES = 4


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of model data for one compute dtype (see the module docstring)."""

    param_bytes: int                  # one element of a compute-dtype chunk

    @classmethod
    def of(cls, dtype: torch.dtype) -> "ModelBytes":
        return cls(torch.empty((), dtype=dtype).element_size())

    @property
    def per_element(self) -> int:
        """A parameter element's compute-dtype copy and its optimizer states."""
        return self.param_bytes + STATE_BYTES

    def param_chunk(self, chunk_size: int) -> int:
        return chunk_size * self.param_bytes

    def state_chunk(self, chunk_size: int) -> int:
        return chunk_size * STATE_BYTES

    def chunk(self, chunk_size: int) -> int:
        """One chunk's compute-dtype copy and optimizer states."""
        return chunk_size * self.per_element

    def host_per_element(self, *, lock_free: bool = False, staleness: int = 1) -> int:
        """Host bytes per owned element when the host holds every chunk's copy and states; lock-free
        updating adds the next parameters' copy and ``staleness + 1`` gradient buffer sets."""
        if not lock_free:
            return self.per_element
        return self.per_element + self.param_bytes + GRAD_BYTES * (staleness + 1)

    def host_bytes(self, layout: ChunkLayout, chunks: Iterable[int], home_numel: int | None = None, *,
                   lock_free: bool = False, staleness: int = 1) -> int:
        """Host bytes of ``chunks``' homes (``home_numel`` elements each: a rank's shard under ZeRO
        by group): every one's compute-dtype copy, and a trainable one's optimizer states over its
        state extent (a whole shard under ZeRO); lock-free updating adds, for trainable chunks, the
        next parameters' copy and the gradient buffer sets."""
        home = layout.chunk_size if home_numel is None else home_numel
        total = 0
        for c in chunks:
            kind = layout.kind(c)
            states = 0 if not kind.has_states else layout.state_extent(c) if home == layout.chunk_size else home
            total += kind.home_bytes(home, self.param_bytes) + states * kind.state_bytes
            if lock_free and kind.updated:
                total += home * (self.param_bytes + GRAD_BYTES * (staleness + 1))
        return total


def fetch_bytes(layout: ChunkLayout, slot_bytes: int) -> tuple[int, ...]:
    """Bytes one fetch of each chunk moves over the link: its slot's, or (NF4) its packed bytes."""
    elsize = slot_bytes // layout.chunk_size
    return tuple(layout.kind(c).home_bytes(layout.chunk_size, elsize) for c in range(layout.num_chunks))


def dequant_workspace(layout: ChunkLayout) -> int:
    """Device bytes a fetch of an NF4 chunk takes beside its slot while it lands (one lands at a
    time: ``nf4.workspace_bytes``); 0 without NF4 chunks."""
    return nf4.workspace_bytes(layout.chunk_size) if layout.quantized_chunks else 0


def owned_chunks(num_chunks: int, *, rank: int = 0, world: int = 1, per_chunk: bool = False) -> list[int]:
    """The chunks one rank keeps homes for: with ZeRO per chunk those dealt to it in turn, else
    every chunk (by group: its shard of each)."""
    return [c for c in range(num_chunks) if not (per_chunk and world > 1) or c % world == rank]


def state_chunks(layout: ChunkLayout, chunks: Iterable[int] | None = None) -> list[int]:
    """Of ``chunks`` (default: all), in order, those whose kind has optimizer states (not frozen)."""
    return [c for c in (range(layout.num_chunks) if chunks is None else chunks) if layout.kind(c).has_states]


def device_homable(layout: ChunkLayout, chunks: Iterable[int] | None = None) -> list[int]:
    """Of ``chunks`` (default: all), in order, those whose kind may have its home on the device
    when the host cannot hold it (``ChunkKind.tiers``): the device homes are the first of these."""
    return [c for c in (range(layout.num_chunks) if chunks is None else chunks) if layout.homed_on(c, Tier.DEVICE)]


def owned_elements(num_chunks: int, chunk_size: int, *, rank: int = 0, world: int = 1, per_chunk: bool = False,
                   device_homes: int = 0) -> int:
    """The parameter elements one rank keeps model data for: with ZeRO, whole chunks dealt out in
    turn (``per_chunk``) or every chunk's ``1 / world`` shard; ``device_homes`` chunks that live on
    the device are not the host's."""
    if per_chunk and world > 1:
        return len(range(rank, num_chunks, world)) * chunk_size
    return (num_chunks - device_homes) * (chunk_size // world)
