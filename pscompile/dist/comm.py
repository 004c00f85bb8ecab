"""The ranks of a ZeRO run and the collectives pscompile issues between them.

``Comm`` wraps a ``torch.distributed`` process group (NCCL on CUDA, gloo on the CPU): no transport
of its own. It counts the bytes each collective moves per rank and, with ``link_bandwidth`` on the
CPU, makes each one take at least ``bytes / bandwidth`` seconds, as ``Link`` does for host<->device
copies, so overlap of communication with compute is measurable on one machine.

Every rank must issue the same collectives in the same order. pscompile guarantees it by planning
from data every rank agrees on: the measured non-model curves are reduced to their maximum over
ranks (``agree_max``) before any plan is made from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommTraffic:
    """Bytes of collectives on this rank, reset at the start of every step."""

    allgather_bytes: int = 0        # received from other ranks by all-gathers (per chunk: broadcasts)
    reduce_scatter_bytes: int = 0   # sent to other ranks by reduce-scatters (per chunk: reduces)
    comm_s: float = 0.0             # time inside collectives (issue to completion, synchronous ones)


class _Delayed:
    """An asynchronous collective's handle whose ``wait`` also waits out the emulated link."""

    def __init__(self, work: Any, seconds: float, where: str):
        self.work = work
        self.where = where
        self.deadline = time.perf_counter() + seconds

    def running(self) -> bool:
        """Whether the collective may still write into its buffer."""
        return not self.work.is_completed()

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as e:
            raise CollectiveError(f"pscompile ZeRO: an asynchronous all-gather failed on {self.where} (another rank "
                                  f"died, stalled "
                                  f"past the process group's timeout, or issued different collectives): {e}") from e
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


class CollectiveError(RuntimeError):
    """A collective with the other ranks failed: a rank died, stalled past the process group's
    timeout, or issued different collectives."""


def _checked(what: str):
    def wrap(fn):
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except (RuntimeError, ValueError) as e:     # DistBackendError is a RuntimeError
                raise CollectiveError(
                    f"pscompile ZeRO: {what} failed on rank {self.rank} of {self.world} (another rank died, stalled "
                    f"past the process group's timeout, or issued different collectives): {e}") from e
        call.__name__, call.__doc__ = fn.__name__, fn.__doc__
        return call
    return wrap


class Comm:
    """One rank's view of the process group pscompile shards over. A failed collective raises
    ``CollectiveError`` naming the rank (the process group's ``timeout`` bounds a stall)."""

    def __init__(self, group: Any, *, bandwidth: float | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.bandwidth = bandwidth
        self.traffic = CommTraffic()

    def reset(self) -> CommTraffic:
        done, self.traffic = self.traffic, CommTraffic()
        return done

    def barrier(self) -> None:
        """Every rank of the group has reached this point (checkpoint files are all in place)."""
        try:
            dist.barrier(group=self.group)
        except Exception as e:
            raise CollectiveError(f"pscompile ZeRO: barrier failed on rank {self.rank} of {self.world}: {e}") from e

    def _delay(self, nbytes: int) -> float:
        return nbytes / self.bandwidth if self.bandwidth else 0.0

    def _finish(self, work: Any, nbytes: int, start: float, async_op: bool):
        if async_op:
            return _Delayed(work, self._delay(nbytes), f"rank {self.rank} of {self.world}")
        remaining = self._delay(nbytes) - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        self.traffic.comm_s += time.perf_counter() - start
        return None

    @_checked("all-gather")
    def all_gather(self, out: torch.Tensor, async_op: bool = False):
        """``out`` is ``world`` equal shards; this rank's shard (already filled) is the input, the
        others arrive from their owners."""
        start = time.perf_counter()
        shard = out.numel() // self.world
        mine = out[self.rank * shard:(self.rank + 1) * shard]
        work = _all_gather(out, mine, group=self.group, async_op=async_op)
        nbytes = (self.world - 1) * shard * out.element_size()
        self.traffic.allgather_bytes += nbytes
        return self._finish(work, nbytes, start, async_op)

    @_checked("reduce-scatter")
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (one shard) <- the sum over ranks of this rank's shard of ``full``."""
        start = time.perf_counter()
        _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=self.group)
        nbytes = (self.world - 1) * out.numel() * out.element_size()
        self.traffic.reduce_scatter_bytes += nbytes
        self._finish(None, nbytes, start, False)

    @_checked("broadcast")
    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        """``t`` <- rank ``src``'s ``t`` (ZeRO per chunk: a chunk from its owner)."""
        start = time.perf_counter()
        work = dist.broadcast(t, src=dist.get_global_rank(self.group, src), group=self.group, async_op=async_op)
        nbytes = 0 if self.rank == src else t.numel() * t.element_size()
        self.traffic.allgather_bytes += nbytes
        return self._finish(work, nbytes, start, async_op)

    @_checked("reduce")
    def reduce(self, t: torch.Tensor, dst: int) -> None:
        """Rank ``dst``'s ``t`` <- the sum over ranks (ZeRO per chunk: gradients to their owner)."""
        start = time.perf_counter()
        dist.reduce(t, dst=dist.get_global_rank(self.group, dst), op=dist.ReduceOp.SUM, group=self.group)
        nbytes = 0 if self.rank == dst else t.numel() * t.element_size()
        self.traffic.reduce_scatter_bytes += nbytes
        self._finish(None, nbytes, start, False)

    @_checked("broadcast of the state")
    def broadcast_plain(self, t: torch.Tensor, src: int) -> None:
        """``t`` <- rank ``src``'s (state export; not counted in steps)."""
        dist.broadcast(t, src=dist.get_global_rank(self.group, src), group=self.group)

    @_checked("all-gather of the state")
    def all_gather_flat(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """``out`` <- every rank's ``mine``, in rank order (state export; not counted in steps)."""
        _all_gather(out, mine, group=self.group)

    @_checked("all-reduce")
    def sum(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    @_checked("all-reduce of the measured memory curve")
    def agree_max(self, values: Sequence[int]) -> tuple[int, ...]:
        """The element-wise maximum over ranks (every rank passes the same length)."""
        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    @_checked("all-gather of objects")
    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def resolve_comm(process_group: Any, *, bandwidth: float | None = None) -> Comm | None:
    """The ``Comm`` for ``Config(process_group=...)``: None shards over the default group when
    torch.distributed is initialized with more than one rank; False never shards; a group shards
    over that group."""
    if process_group is False:
        return None
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        process_group = dist.group.WORLD
    if dist.get_world_size(process_group) == 1:
        return None
    return Comm(process_group, bandwidth=bandwidth)
