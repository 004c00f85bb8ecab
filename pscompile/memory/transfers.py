"""The copy engines: transfers that run in order on background threads, overlapping compute.

Compiled mode submits each memory node's copy here; a fetch with a ``wait`` returns at once and
the ``wait`` blocks on its future. Like a GPU, there is one copy engine per direction (PCIe is full
duplex): host->device copies run in submission order on one thread, device->host copies on
another, so a writeback crosses while the next fetch does. A copy that must follow one of the other
direction (a fetch of a chunk whose writeback is still landing) names it with ``after``. Bytes and
busy time are counted by the ``Link`` as each copy runs, so what a step moved is read from the link
after ``flush``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pscompile.memory.tiers import Link

DIRECTIONS = ("h2d", "d2h")


class TransferQueue:
    """Copies that run in submission order per direction, each direction on a background thread
    of its own, like a GPU's copy engines (or the emulated link, full duplex): ``submit`` returns
    at once, ``Future.result()`` waits for one copy, ``flush`` for all. Bytes and busy time are
    counted by the ``Link`` as each copy runs.

    ``after``: a future (of the other direction) the copy must wait for before it starts; the
    copy engine waits, not the caller. ``counted``: the caller counted the bytes as it issued the
    copy (``Link.count``), so a copy still landing when the counters are read is in them.

    ``inline_bytes``: a copy between CPU tensors of at most this many bytes, over a link that is
    not emulated, runs inside ``submit`` when no earlier copy of its direction (nor ``after``) is
    still running (so the order holds) and returns a finished future; a thread hand-off costs more
    than a small memcpy."""

    def __init__(self, link: Link, *, inline_bytes: int = 0):
        self.link = link
        self.inline_bytes = inline_bytes
        self._pools = {d: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pscompile-{d}") for d in DIRECTIONS}
        self._pending: list = []
        self._last: dict[str, Future | None] = dict.fromkeys(DIRECTIONS)

    def submit(self, dst: torch.Tensor, src: torch.Tensor, direction: str, activation: bool = False, *,
               after: Future | None = None, counted: bool = False) -> Future:
        if direction not in self._pools:
            raise AssertionError(f"unknown direction {direction}")
        last = self._last[direction]
        if (src.numel() * src.element_size() <= self.inline_bytes and self.link.bandwidth is None
                and src.device.type == "cpu" and dst.device.type == "cpu"
                and (last is None or last.done()) and (after is None or after.done())):
            # a small memcpy costs less than handing it to the thread; every earlier copy it
            # follows is done, so running it here keeps the order
            fut: Future = Future()
            try:
                self.link.copy(dst, src, direction, activation, counted=counted)
                fut.set_result(None)
            except BaseException as e:         # noqa: BLE001 -- raised where the caller waits
                fut.set_exception(e)
            del dst, src
            return fut
        # The tensors travel in a list the copy empties before it returns: the pool's work item
        # outlives the future's result by a moment on the worker thread, and a tensor it still
        # held (a gradient stored to the host, an offloaded activation) would outlive its planned
        # death by that moment, which the memory tracker can see.
        fut = self._pools[direction].submit(self._copy, [dst, src, direction, activation, after, counted])
        if len(self._pending) >= 256:          # (a caller that never flushes: forget the copies that
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]  # landed)
        self._pending.append(fut)
        self._last[direction] = fut
        return fut

    def _copy(self, job: list) -> None:
        dst, src, direction, activation, after, counted = job
        job.clear()
        if after is not None:
            after.result()            # what this copy reads or overwrites is written by that one
        self.link.copy(dst, src, direction, activation, counted=counted)

    def flush(self) -> None:
        """Wait for every copy; then raise the first one's exception, if any failed."""
        errors = self.drain()
        if errors:
            raise errors[0]

    def drain(self) -> list[BaseException]:
        """Wait for every copy (none is left running) and return the exceptions of those that
        failed: after a failed step, so that its recovery runs whatever the copies did."""
        pending, self._pending = self._pending, []
        errors = []
        for fut in pending:
            try:
                fut.result()
            except BaseException as e:          # noqa: BLE001 -- collected, raised by flush
                errors.append(e)
        return errors

    def idle(self) -> bool:
        """No copy queued or running."""
        return all(f.done() for f in self._pending) and all(pool._work_queue.empty() for pool in self._pools.values())

    def close(self) -> None:
        self.drain()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
