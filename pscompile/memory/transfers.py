"""The copy engine: transfers that run in order on one background thread, overlapping compute.

Compiled mode submits each memory node's copy here; a fetch with a ``wait`` returns at once and
the ``wait`` blocks on its future. Bytes and busy time are counted by the ``Link`` as each copy
runs, so what a step moved is read from the link after ``flush``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pscompile.memory.tiers import Link


class TransferQueue:
    """Copies that run in submission order on one background thread, like a GPU's copy engine
    (or the emulated link): ``submit`` returns at once, ``Future.result()`` waits for one copy,
    ``flush`` for all. Bytes and busy time are counted by the ``Link`` as each copy runs.

    ``inline_bytes``: a copy between CPU tensors of at most this many bytes, over a link that is
    not emulated, runs inside ``submit`` when no earlier copy is still running (so the order
    holds) and returns a finished future; a thread hand-off costs more than a small memcpy."""

    def __init__(self, link: Link, *, inline_bytes: int = 0):
        self.link = link
        self.inline_bytes = inline_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pscompile-link")
        self._pending: list = []
        self._last: Future | None = None

    def submit(self, dst: torch.Tensor, src: torch.Tensor, direction: str, activation: bool = False) -> Future:
        if (src.numel() * src.element_size() <= self.inline_bytes and self.link.bandwidth is None
                and src.device.type == "cpu" and dst.device.type == "cpu"
                and (self._last is None or self._last.done())):
            # a small memcpy costs less than handing it to the thread; every earlier copy is done,
            # so running it here keeps the queue's order
            fut: Future = Future()
            try:
                self.link.copy(dst, src, direction, activation)
                fut.set_result(None)
            except BaseException as e:         # noqa: BLE001 -- raised where the caller waits
                fut.set_exception(e)
            del dst, src
            return fut
        # The tensors travel in a list the copy empties before it returns: the pool's work item
        # outlives the future's result by a moment on the worker thread, and a tensor it still
        # held (a gradient stored to the host, an offloaded activation) would outlive its planned
        # death by that moment, which the memory tracker can see.
        fut = self._pool.submit(self._copy, [dst, src, direction, activation])
        self._pending.append(fut)
        self._last = fut
        return fut

    def _copy(self, job: list) -> None:
        dst, src, direction, activation = job
        job.clear()
        self.link.copy(dst, src, direction, activation)

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

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
