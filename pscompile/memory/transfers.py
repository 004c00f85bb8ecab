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
    ``flush`` for all. Bytes and busy time are counted by the ``Link`` as each copy runs."""

    def __init__(self, link: Link):
        self.link = link
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pscompile-link")
        self._pending: list = []

    def submit(self, dst: torch.Tensor, src: torch.Tensor, direction: str, activation: bool = False) -> Future:
        # The tensors travel in a list the copy empties before it returns: the pool's work item
        # outlives the future's result by a moment on the worker thread, and a tensor it still
        # held (a gradient stored to the host, an offloaded activation) would outlive its planned
        # death by that moment, which the memory tracker can see.
        fut = self._pool.submit(self._copy, [dst, src, direction, activation])
        self._pending.append(fut)
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
