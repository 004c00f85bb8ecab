"""Optimizer states on the disk tier: the chunks whose fp32 master, exp_avg and exp_avg_sq fit
neither the device nor the host live in three slots each of the disk tier's file.

Their compute-dtype param chunk stays on the host (forward and backward fetch it as usual). The
update of such a chunk *stages* its three buffers into host buffers (reads on the disk thread),
updates there, and writes them back; the next disk chunk's reads are queued before this chunk's
update starts, so the disk works while the CPU updates. At most three chunks are staged at once
(the one updating, the next one arriving and the last one leaving) and written buffers go back
to the host pool as soon as their writes land, so the host needs ``3 x 12`` bytes per chunk
element for staging. (With two, the next chunk's reads wait for the last one's writes, and
queueing them early gained little over reading each chunk when its update starts.)

Reading or writing a few parameters (state dicts, undoing a failed step) goes through a one-chunk
cache that is written back when another chunk is needed and at ``flush``.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from pscompile.memory.disk import DiskQueue
from pscompile.memory.tiers import SlotPool

LISTS = ("master", "exp_avg", "exp_avg_sq")
STAGED_SETS = 3          # chunks staged at once: the one updating, the next arriving, the last leaving


class DiskStates:
    def __init__(self, queue: DiskQueue, chunks: list[int], pool: SlotPool):
        self.queue = queue
        self.pool = pool
        self.slot_of = {c: 3 * i for i, c in enumerate(sorted(chunks))}   # + 0, 1, 2 for the three lists
        self._reading: dict[int, tuple[list[torch.Tensor], list[Future]]] = {}
        self._writing: list[tuple[list[torch.Tensor], list[Future]]] = []
        self._taken: dict[int, list[torch.Tensor]] = {}   # handed out for their update, not yet written back
        self._cache: tuple[int, list[torch.Tensor], bool] | None = None     # chunk, buffers, dirty
        self._fresh = set(self.slot_of)     # chunks never written: their slots hold zeros, read none

    # ---- the update: stage, update, write back ----------------------------------------------
    def stage(self, c: int) -> None:
        """Start reading chunk ``c``'s three buffers (returns at once)."""
        if c in self._reading:
            return
        self.flush()
        while self._writing and len(self._writing) + len(self._reading) + len(self._taken) >= STAGED_SETS:
            self._release_oldest_write()
        bufs, futs = self._read(c)
        self._reading[c] = (bufs, futs)

    def take(self, c: int) -> list[torch.Tensor]:
        """Chunk ``c``'s three buffers on the host, read (staged first if it was not)."""
        self.stage(c)
        bufs, futs = self._reading.pop(c)
        self._taken[c] = bufs                 # given back by write_back, or by settle after a failure
        for f in futs:
            f.result()
        return bufs

    def write_back(self, c: int, bufs: list[torch.Tensor]) -> None:
        """Queue the writes of chunk ``c``'s updated buffers; they return to the pool once written."""
        futs = [self.queue.write(self.slot_of[c] + k, b) for k, b in enumerate(bufs)]
        self._writing.append((bufs, futs))
        self._fresh.discard(c)
        del self._taken[c]

    def _release_oldest_write(self) -> None:
        bufs, futs = self._writing.pop(0)
        try:
            for f in futs:
                f.result()
        finally:
            for b in bufs:
                self.pool.release(b)

    def settle(self) -> None:
        """Wait for every queued transfer and give every staging buffer back (end of an update,
        or after a failure: then the first transfer error is raised after everything is back)."""
        self.flush()
        errors = self.queue.drain()
        for bufs, _ in list(self._reading.values()) + self._writing + [(b, None) for b in self._taken.values()]:
            for b in bufs:
                self.pool.release(b)
        self._reading.clear()
        self._writing.clear()
        self._taken.clear()
        if errors:
            raise errors[0]

    # ---- a few parameters at a time ----------------------------------------------------------
    def buffers(self, c: int) -> list[torch.Tensor]:
        """Chunk ``c``'s three buffers through the one-chunk cache (``mark_dirty`` after writing)."""
        if self._cache is not None and self._cache[0] == c:
            return self._cache[1]
        self.flush()
        bufs, futs = self._read(c)
        for f in futs:
            f.result()
        self._cache = (c, bufs, False)
        return bufs

    def mark_dirty(self, c: int) -> None:
        assert self._cache is not None and self._cache[0] == c
        self._cache = (c, self._cache[1], True)

    def flush(self) -> None:
        """Write the cached chunk back if it changed, and give its buffers back."""
        if self._cache is None:
            return
        c, bufs, dirty = self._cache
        self._cache = None
        try:
            if dirty:
                self._fresh.discard(c)
                for f in [self.queue.write(self.slot_of[c] + k, b) for k, b in enumerate(bufs)]:
                    f.result()
        finally:
            for b in bufs:
                self.pool.release(b)

    def _read(self, c: int) -> tuple[list[torch.Tensor], list[Future]]:
        """Host buffers for chunk ``c``'s three lists and their reads (a chunk never written is
        zeros: no read)."""
        if c in self._fresh:
            done: Future = Future()
            done.set_result(0)
            return [self.pool.acquire(zero=True) for _ in LISTS], [done] * len(LISTS)
        bufs = [self.pool.acquire() for _ in LISTS]
        return bufs, [self.queue.read(self.slot_of[c] + k, b) for k, b in enumerate(bufs)]

    def close(self) -> None:
        try:
            self.flush()
            self.settle()
        finally:
            self.queue.close()
