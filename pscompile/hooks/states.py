"""Tensor states and the chunk placement rules of PatrickStar (Table 1).

A chunk's place follows from the states of the tensors in it:
- all FREE                     -> the chunk needs no payload (it may be released or reused);
- any COMPUTE                  -> the chunk must be on the computing device (it may not move);
- otherwise (a HOLD-like state) -> the chunk may be anywhere (device, host), so it may be evicted.
"""

from __future__ import annotations

import enum
from typing import Iterable


class TensorState(enum.Enum):
    FREE = "free"                      # no payload
    COMPUTE = "compute"                # taking part in an operator right now: on the computing device
    HOLD = "hold"                      # payload held, device or host
    HOLD_AFTER_FWD = "hold_after_fwd"  # payload held after its forward use
    HOLD_AFTER_BWD = "hold_after_bwd"  # payload held after its backward use (now holds the gradient)


class ChunkPlacement(enum.Enum):
    RELEASABLE = "releasable"      # every tensor FREE: no payload needed
    COMPUTE_DEVICE = "compute"     # some tensor in COMPUTE: pinned on the computing device
    ANYWHERE = "anywhere"          # HOLD-like: may live on any tier; an eviction candidate


def chunk_placement(states: Iterable[TensorState]) -> ChunkPlacement:
    """Where a chunk may live given its tensors' states (PatrickStar Table 1)."""
    states = list(states)
    if any(s is TensorState.COMPUTE for s in states):
        return ChunkPlacement.COMPUTE_DEVICE
    if all(s is TensorState.FREE for s in states):
        return ChunkPlacement.RELEASABLE
    return ChunkPlacement.ANYWHERE


def is_hold_like(state: TensorState) -> bool:
    return state in (TensorState.HOLD, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD)
