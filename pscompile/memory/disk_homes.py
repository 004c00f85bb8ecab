"""Chunks whose home is the disk tier: a write-back cache of a few host buffers.

When the host cannot hold even the compute-dtype chunks, the last chunks keep their parameters
(and, after a backward, their gradients: PatrickStar's grad-over-param trick) in one slot each of
the disk tier's file, next to their optimizer states (``memory/disk_states.py``); an NF4 chunk's
home (``packed``) is its packed bytes, the first bytes of a buffer and of its slot. The store
reaches such a chunk's home through this cache instead of a host buffer of its own:

- ``open(c)`` gives a host buffer holding chunk ``c``'s home (read from disk unless it is cached,
  or ``read=False`` when the caller overwrites all of it: a whole dirty chunk going home);
  ``close(c, dirty=..., copy=...)`` hands it back, with the device copy still reading or writing
  it (the buffer is not reused, or written to disk, before that copy lands).
- A dirty buffer is written back lazily: when its buffer is needed for another chunk, or at
  ``flush`` (the end of every step and of every operation outside one), so the file is the truth
  whenever no step runs.
- ``expect(order)`` names the chunks the run will open next, in order; after every ``open`` the
  cache queues the reads of the next ones into free buffers (read-ahead), so the disk works while
  the device computes. Prefetched buffers are kept until they are opened.

At most ``capacity`` buffers exist at once, counting those whose write-back is still landing:
the host's staging bytes for the disk homes are ``capacity x`` one chunk, whatever the model size.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pscompile.memory.disk import DiskQueue
from pscompile.memory.disk_states import STAGED_SETS
from pscompile.memory.tiers import SlotPool

# host buffers of the disk homes: the one a fetch or an update uses, two read ahead, one writing back
HOME_BUFFERS = 4
READ_AHEAD = HOME_BUFFERS - 2        # chunks read ahead of their fetch (compiled mode: disk_read nodes)
# host buffers of gradient accumulation on disk: the chunk being added into, the last one's write
ACC_BUFFERS = 2


def disk_staging_bytes(chunk_elements: int, param_bytes: int) -> int:
    """Host bytes of the disk tier's staging buffers when parameters live on disk: ``HOME_BUFFERS``
    compute-dtype chunks, ``ACC_BUFFERS`` fp32 gradient accumulation buffers, and the optimizer
    states of ``STAGED_SETS`` chunks (``disk_states``)."""
    return (HOME_BUFFERS * param_bytes + ACC_BUFFERS * 4 + STAGED_SETS * 12) * chunk_elements


@dataclass
class _Entry:
    buf: torch.Tensor
    reading: Future | None = None     # its disk read, still in flight
    dirty: bool = False               # newer than the disk copy
    users: int = 0                    # opened and not closed
    copy: object | None = None        # a device copy (memory.copies.Copy) still using buf
    ahead: bool = False               # read ahead and not opened yet


class DiskHomes:
    def __init__(self, queue: DiskQueue, slot_of: dict[int, int], pool: SlotPool, *, capacity: int = HOME_BUFFERS,
                 packed: dict[int, int] | None = None):
        if capacity < 2:
            raise ValueError(f"the disk homes need at least 2 host buffers, not {capacity}")
        self.queue = queue
        self.slot_of = dict(slot_of)
        self.packed = dict(packed or {})      # chunk -> its bytes, for a home of packed bytes (NF4)
        self.pool = pool
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()     # least recently used first
        self._writing: deque[tuple[torch.Tensor, Future]] = deque()
        self._upcoming: deque[int] = deque()
        self._skip = None
        self._fresh = set(self.slot_of)     # chunks never written: zeros on disk, read none

    def __contains__(self, c: int) -> bool:
        return c in self.slot_of

    def _home(self, c: int, buf: torch.Tensor) -> torch.Tensor:
        """Chunk ``c``'s home in a buffer of the pool: all of it, or (packed) its first bytes;
        what is read from and written to disk."""
        n = self.packed.get(c)
        return buf if n is None else buf.view(torch.uint8)[:n]

    # ---- the cache --------------------------------------------------------------------------
    def open(self, c: int, *, read: bool = True) -> torch.Tensor:
        """Chunk ``c``'s home in a host buffer (its disk copy read first unless ``read=False``)."""
        e = self._entries.get(c)
        if e is None:
            self._make_room()
            e = self._new_entry(c, read=read)
        self._entries.move_to_end(c)
        self._wait(e)
        e.users += 1
        e.ahead = False
        head = list(self._upcoming)[:self.capacity]
        if c in head:                     # (those before it were skipped: already on the device)
            for _ in range(head.index(c) + 1):
                self._upcoming.popleft()
        self._read_ahead()
        return self._home(c, e.buf)

    def close(self, c: int, *, dirty: bool = False, copy=None) -> None:
        """Hand chunk ``c``'s buffer back (``dirty``: it was written; ``copy``: a device copy still
        using it)."""
        e = self._entries[c]
        assert e.users > 0, f"disk home {c} closed more often than opened"
        e.users -= 1
        e.dirty |= dirty
        if copy is not None:
            e.copy = copy

    def expect(self, order, *, skip=None) -> None:
        """The chunks the run opens next, in order: read ahead into free buffers, except those
        ``skip(c)`` says need no read now (on the device already)."""
        self._upcoming = deque()
        for c in order:
            if c in self.slot_of and (not self._upcoming or self._upcoming[-1] != c):
                self._upcoming.append(c)
        self._skip = skip
        self._read_ahead()

    def _read_ahead(self) -> None:
        for c in list(self._upcoming)[:max(1, self.capacity - 2)]:
            if c in self._entries or (self._skip is not None and self._skip(c)):
                continue
            if not self._room_without_waiting():
                return
            self._new_entry(c, ahead=True)

    def prefetch(self, c: int) -> None:
        """Queue chunk ``c``'s read into a buffer of its own (a ``disk_read`` node), unless it is
        cached; kept until it is opened."""
        if c in self._entries:
            return
        self._make_room()
        self._new_entry(c, ahead=True)

    def _new_entry(self, c: int, *, read: bool = True, ahead: bool = False) -> _Entry:
        """A buffer of the cache for chunk ``c`` with its disk read queued (``read=False``: none;
        a chunk never written is zeros, read from nowhere)."""
        fresh = c in self._fresh
        e = self._entries[c] = _Entry(self.pool.acquire(zero=read and fresh), ahead=ahead)
        if read and not fresh:
            e.reading = self.queue.read(self.slot_of[c], self._home(c, e.buf))
        return e

    def _room_without_waiting(self) -> bool:
        if len(self._entries) + len(self._writing) < self.capacity:
            return True
        victim = next((c for c, e in self._entries.items() if not e.users and not e.ahead and not e.dirty), None)
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _make_room(self) -> None:
        """Free one buffer: the least recently used clean closed chunk's, else the oldest write's
        once it lands, else a dirty closed chunk's (its write queued), read-ahead ones last. The
        choice never depends on timing, so a schedule moves the same disk bytes every step."""
        while len(self._entries) + len(self._writing) >= self.capacity:
            closed = [c for c, e in self._entries.items() if not e.users]
            clean = next((c for c in closed if not self._entries[c].ahead and not self._entries[c].dirty), None)
            if clean is not None:
                self._evict(clean)
            elif self._writing:
                self._finish_write(*self._writing.popleft())
            else:
                victim = next((c for c in closed if not self._entries[c].ahead), closed[0] if closed else None)
                if victim is None:
                    raise RuntimeError(f"all {self.capacity} disk-home buffers are in use; the store opened more "
                                       "chunks at once than the disk tier stages")
                self._evict(victim)

    def _evict(self, c: int) -> None:
        e = self._entries.pop(c)
        self._wait(e)
        if e.dirty:
            self._fresh.discard(c)
            self._writing.append((e.buf, self.queue.write(self.slot_of[c], self._home(c, e.buf))))
        else:
            self.pool.release(e.buf)

    def _wait(self, e: _Entry) -> None:
        """Wait for the disk read filling ``e`` and the device copy using it."""
        if e.reading is not None:
            reading, e.reading = e.reading, None
            reading.result()
        if e.copy is not None:
            copy, e.copy = e.copy, None
            copy.wait_host()

    def _finish_write(self, buf: torch.Tensor, fut: Future) -> None:
        try:
            fut.result()
        finally:
            self.pool.release(buf)

    # ---- the end of a step ----------------------------------------------------------------
    def flush(self) -> None:
        """Write every dirty buffer back, wait for the writes and give every buffer back (the
        file is the truth again; a buffer still open, after a failure, is closed)."""
        self._upcoming.clear()
        error = None
        for c in list(self._entries):
            try:
                self._evict(c)
            except BaseException as ex:      # noqa: BLE001 -- raised below, after every buffer is back
                error = error or ex
        while self._writing:
            try:
                self._finish_write(*self._writing.popleft())
            except BaseException as ex:      # noqa: BLE001
                error = error or ex
        if error is not None:
            raise error

    def reset(self) -> None:
        """Every chunk holds zeros again (gradient accumulation's buffers after an update): cached
        buffers are dropped unwritten, writes still landing finish, and nothing is read back."""
        for e in self._entries.values():
            self._wait(e)
            self.pool.release(e.buf)
        self._entries.clear()
        while self._writing:
            self._finish_write(*self._writing.popleft())
        self._fresh = set(self.slot_of)
        self._upcoming.clear()


class DiskAccumulation:
    """Gradient accumulation's fp32 buffers, one per chunk, on the disk tier (when the parameters
    are on disk, the host holds none of them): ``open(c)`` / ``close(c, dirty=...)`` around each
    use, through a ``DiskHomes`` cache; ``zero_()`` after the update. Indexing it is refused, so no
    caller can keep a buffer past its ``close``."""

    def __init__(self, homes: DiskHomes, num_chunks: int):
        self.homes = homes
        self.num_chunks = num_chunks

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, c):
        raise TypeError("gradient accumulation buffers on disk are reached with open(c) / close(c)")

    def open(self, c: int) -> torch.Tensor:
        return self.homes.open(c)

    def close(self, c: int, *, dirty: bool = False) -> None:
        self.homes.close(c, dirty=dirty)

    def zero_(self) -> None:
        self.homes.reset()


def zero_accumulation(acc) -> None:
    """Zero gradient accumulation buffers: a list of host tensors, or ``DiskAccumulation``."""
    if isinstance(acc, DiskAccumulation):
        acc.zero_()
    else:
        for a in acc:
            a.zero_()
