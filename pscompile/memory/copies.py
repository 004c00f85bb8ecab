"""The copy contract: how every byte crosses between device and host, with two implementations.

A copy engine runs copies of each direction (``"h2d"``, ``"d2h"``) in submission order, the two
directions independently (PCIe is full duplex). What it promises, and what callers must do:

- ``submit(dst, src, direction, after=, node=)`` returns a ``Copy`` handle at once. The copy reads
  ``src`` as compute left it at the moment of the submit, and may write ``dst`` at any moment up to
  the wait. ``after``: a copy (of the other direction) this one must follow, because it reads or
  overwrites what that one writes; ``node``: the graph node that issued it, for error messages.
- ``Copy.wait()`` is the compute-side wait: compute issued after it sees ``dst`` written, and both
  buffers may then be freed or reused by compute (on CUDA the compute stream waits on the copy's
  event; the host does not block). ``Copy.wait_host()`` is the host-side wait, where the host itself
  reads the data (the host optimizer reading a landed gradient): the host blocks until it landed.
- Until one of the two waits, neither buffer may be freed, reused or written by anyone, and ``dst``
  may not be read. ``flush()`` waits for every copy on the host; ``drain()`` does too and returns
  their errors instead of raising (recovery after a failed step).
- A compute-side wait orders compute, not the host: the host may write a host buffer an h2d copy
  reads, or read one a d2h copy writes, only once it knows the copy landed -- after a host-side
  wait on it, on a later copy of its direction or on any copy submitted after its compute-side
  wait, after a flush, or after ``sync_compute()`` (the host waits for compute).
- ``move(dst, src, direction)``: a synchronous move (submit, then the wait the direction needs: a
  copy to the host is waited on the host, which may read it next; one to the device on compute).
- Bytes are counted by the ``Link`` exactly once per copy, as today; ``counted=True`` says the
  caller counted them when it issued the copy (``Link.count``).

``ThreadCopies`` (the CPU): one background thread per direction over the emulated link; small copies
run inline. ``StrictCopies`` (``memory/strict_copies.py``, the CPU race checker, ``Config(strict_copies=True)``
or ``PSCOMPILE_STRICT_COPIES=1``): every copy lands at the latest moment the contract allows -- the
destination is poisoned at submit, the source read only at the wait -- and a buffer freed or reused
while a copy still owns it raises ``CopyRaceError`` naming the node. ``CudaCopies``
(``memory/cuda_copies.py``): a stream per direction, events, event-gated frees.
``memory/copy_engines.make_copy_engine`` picks one for a device.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes

from pscompile import profiling
from pscompile.memory.tiers import Link

Direction = Literal["h2d", "d2h"]
DIRECTIONS: tuple[Direction, ...] = ("h2d", "d2h")
# A copy of at most this many bytes between CPU tensors, with no emulated link and no copy of its
# direction in flight, runs on the calling thread: handing it to a copy thread and waiting costs
# more (tens of microseconds) than the memcpy itself. Larger copies, and all copies over an
# emulated link, run on the copy threads and overlap compute.
INLINE_COPY_BYTES = 256 * 1024


class CopyRaceError(RuntimeError):
    """The race checker saw a buffer freed, reused or overwritten while a copy still owned it."""


class Copy(ABC):
    """The handle of one submitted copy."""

    node: str | None = None

    @abstractmethod
    def wait(self) -> None:
        """Compute-side wait: compute after this sees the copy landed; its buffers may be reused."""

    @abstractmethod
    def wait_host(self) -> None:
        """Host-side wait: the host blocks until the copy landed (it reads the data itself)."""

    @abstractmethod
    def done(self) -> bool:
        """The copy has landed (a copy not yet waited on may still be running)."""


class Landed(Copy):
    """A copy with nothing left to wait for: the data is already in place (a warm start finds the
    chunk a plan's ``wait`` expects already in its slot)."""

    def wait(self) -> None:
        pass

    def wait_host(self) -> None:
        pass

    def done(self) -> bool:
        return True


class CopyEngine(ABC):
    """What every copy engine offers (the contract is the module docstring)."""

    pins_host = False       # host buffers are page-locked (CUDA, ``Config.pinned_host``)

    def __init__(self, link: Link):
        self.link = link

    @abstractmethod
    def submit(self, dst: torch.Tensor, src: torch.Tensor, direction: Direction, *, after: Copy | None = None,
               activation: bool = False, counted: bool = False, node: str | None = None) -> Copy: ...

    def move(self, dst: torch.Tensor, src: torch.Tensor, direction: Direction, *, node: str | None = None) -> None:
        """A synchronous move: to the host waited on the host (it may read it next), to the device on compute."""
        copy = self.submit(dst, src, direction, node=node)
        copy.wait_host() if direction == "d2h" else copy.wait()

    def sync_compute(self) -> None:
        """The host waits until compute has run all it was given, and so every copy compute waited
        on. On the CPU compute is the host: nothing to wait for (the race checker shows those
        copies' results to the host from here on); CUDA synchronizes the compute stream."""

    @abstractmethod
    def drain(self) -> list[BaseException]:
        """Wait for every copy on the host and return the errors of those that failed."""

    def flush(self) -> None:
        """Wait for every copy on the host; then raise the first one's exception, if any failed."""
        errors = self.drain()
        if errors:
            raise errors[0]

    @abstractmethod
    def idle(self) -> bool:
        """No copy queued, in flight, or (the race checker) waiting to land."""

    def check_free(self, buf: torch.Tensor, node: str | None = None) -> None:
        """``buf``'s memory is about to be freed or reused (the race checker raises if a copy owns it)."""

    def host_empty(self, shape, dtype: torch.dtype, stride=None) -> torch.Tensor:
        """A host buffer copies to or from the device can run asynchronously with (pinned on CUDA)."""
        if stride is None:
            return torch.empty(shape, dtype=dtype)
        return torch.empty_strided(shape, stride, dtype=dtype)

    def close(self) -> None:
        # (also called by an engine's finalizer, at whatever point the garbage collector runs it:
        # perhaps inside a fake-tensor kernel of another engine's tracing, which sends every
        # tensor op to the meta device until it returns)
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(False)
        try:
            with _disable_current_modes():
                self.drain()
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


def settle(futures: list[Future]) -> list[BaseException]:
    """Wait for every future; the exceptions of those that failed (none is left running)."""
    errors = []
    for fut in futures:
        try:
            fut.result()
        except BaseException as e:          # noqa: BLE001 -- collected for the caller
            errors.append(e)
    return errors


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"copy direction {direction!r}: use one of {DIRECTIONS}")


class _FutureCopy(Copy):
    """A copy running on a thread: both waits block until it landed (the CPU is the compute device)."""

    def __init__(self, future: Future, node: str | None):
        self.future, self.node = future, node

    def wait(self) -> None:
        self.future.result()

    wait_host = wait

    def done(self) -> bool:
        return self.future.done()


class ThreadCopies(CopyEngine):
    """The CPU copy engine: copies of one direction run in submission order on a background thread
    of their own (like a GPU's copy engines, or the emulated link, full duplex); ``submit`` returns
    at once. ``after`` is waited for by the copy thread, not the caller.

    ``inline_bytes``: a copy between CPU tensors of at most this many bytes, over a link that is
    not emulated, runs inside ``submit`` when no earlier copy of its direction (nor ``after``) is
    still running (so the order holds) and returns a landed handle; a thread hand-off costs more
    than a small memcpy."""

    def __init__(self, link: Link, *, inline_bytes: int = 0):
        super().__init__(link)
        self.inline_bytes = inline_bytes
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pending: list[Future] = []
        self._last: dict[str, Future | None] = dict.fromkeys(DIRECTIONS)
        self._landed: Future = Future()        # the handle of every inline copy that succeeded
        self._landed.set_result(None)          # (a Future costs a lock and a condition to make)

    def submit(self, dst, src, direction, *, after=None, activation=False, counted=False, node=None) -> Copy:
        _check_direction(direction)
        last, wait_for = self._last[direction], after.future if after is not None else None
        if (src.numel() * src.element_size() <= self.inline_bytes and self.link.bandwidth is None
                and src.device.type == "cpu" and dst.device.type == "cpu"
                and (last is None or last.done()) and (wait_for is None or wait_for.done())):
            # every earlier copy it follows is done, so running it here keeps the order
            fut: Future = self._landed
            try:
                with profiling.maybe(f"copy {direction} {node or ''} (inline)"):
                    self.link.copy(dst, src, direction, activation, counted=counted)
            except BaseException as e:         # noqa: BLE001 -- raised where the caller waits
                fut = Future()
                fut.set_exception(e)
            del dst, src
            return _FutureCopy(fut, node)
        # The tensors travel in a list the copy empties before it returns: the pool's work item
        # outlives the future's result by a moment on the worker thread, and a tensor it still
        # held (a gradient stored to the host, an offloaded activation) would outlive its planned
        # death by that moment, which the memory tracker can see.
        pool = self._pools.get(direction)
        if pool is None:
            pool = self._pools[direction] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pscompile-{direction}")
        fut = pool.submit(self._copy, [dst, src, direction, activation, wait_for, counted, node, time.perf_counter()])
        if len(self._pending) >= 256:          # (a caller that never flushes: forget the copies that landed)
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(fut)
        self._last[direction] = fut
        return _FutureCopy(fut, node)

    def _copy(self, job: list) -> None:
        dst, src, direction, activation, after, counted, node, ready = job
        job.clear()
        if after is not None and not after.done():
            after.result()            # what this copy reads or overwrites is written by that one
            ready = time.perf_counter()
        with profiling.maybe(f"copy {direction} {node or ''}"):     # (this thread's lane in a trace)
            self.link.copy(dst, src, direction, activation, counted=counted, ready=ready)

    def move(self, dst, src, direction, *, node=None) -> None:
        """Synchronous: runs here, after the copies of its direction still queued."""
        _check_direction(direction)
        last = self._last[direction]
        if last is not None and not last.done():
            last.result()
        with profiling.maybe(f"copy {direction} {node or ''} (inline)"):
            self.link.copy(dst, src, direction)

    def drain(self) -> list[BaseException]:
        pending, self._pending = self._pending, []
        return settle(pending)

    def idle(self) -> bool:
        """No copy queued or running."""
        return all(f.done() for f in self._pending)

    def close(self) -> None:
        super().close()
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()
