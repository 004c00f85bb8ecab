"""How many bytes model data takes: one answer for every caller (the engine's host check, the
minimum budget, the placement rule, the planner).

Model data per parameter element: its compute-dtype copy (``param_bytes``, the chunk a step reads)
and its optimizer states, an fp32 master and Adam's two moments (``STATE_BYTES`` = 3 x 4). A chunk
of ``chunk_size`` elements is one of each. Lock-free updating (``Config(lock_free=True)``) adds on
the host a second compute-dtype copy (the next parameters, written by the update thread) and
``staleness + 1`` fp32 gradient buffer sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# fp32 master + exp_avg + exp_avg_sq, per element
STATE_BYTES = 3 * 4
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


def owned_elements(num_chunks: int, chunk_size: int, *, rank: int = 0, world: int = 1, per_chunk: bool = False,
                   device_homes: int = 0) -> int:
    """The parameter elements one rank keeps model data for: with ZeRO, whole chunks dealt out in
    turn (``per_chunk``) or every chunk's ``1 / world`` shard; ``device_homes`` chunks that live on
    the device are not the host's."""
    if per_chunk and world > 1:
        return len(range(rank, num_chunks, world)) * chunk_size
    return (num_chunks - device_homes) * (chunk_size // world)
