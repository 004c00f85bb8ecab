"""Chunk updates that start in the backward (the ``update`` nodes of ``passes/plan_early_updates``).

ZeRO-Offload runs the CPU's Adam on one chunk while the GPU goes on with the backward. Here a
chunk whose gradients are final at home is updated on a host thread of its own while the backward
goes on, and the step's guarantees still hold:

- **Out of place.** The update reads the chunk's gradient, master and Adam moments and writes the
  new master, moments and params into spare buffers from the store's pools. The old ones are left
  as they were, and the same bytes move as in place. At the commit the spares become the chunk's
  buffers (``swap_home``), and the old ones are the spares of the next step. Dropping
  an early update costs nothing: nothing it read was changed.
- **The factor is a guess.** The update needs the gradient factor: the loss-scale inverse times the
  clip coefficient. The inverse is known before the backward; the clip coefficient needs the
  global norm. The early update assumes no clipping, which is exact whenever the coefficient
  comes out 1.0: the same float, so the same bits as the update after the backward. The chunk's
  norm is computed where that update would compute it, and the step sums the norms in chunk
  order as before. If the coefficient is below 1, the early updates are dropped and the step
  updates every chunk as before. The next step makes no guess while the last one clipped.
- **Failures.** Anything that fails before the commit drops them too: the backward, the norm, an
  inf/NaN, or the thread's norm. So does a skipped step. Then the step goes on as if nothing had
  started: it is skipped, undone, or it raises.
- **Each commit waits for its own update only.** The step needs every early chunk's norm before
  it knows its factor. It reads it from the chunk's device slot while the gradient still lands,
  as it does for the other chunks, or else waits for the job, which computes it first. It then
  commits each chunk in its turn, waiting for that chunk's update alone, while the rest of the
  step (the other chunks' updates, the next step's fetches) goes on. An update that has not
  started by then is cancelled, and one that failed after its norm left the chunk's buffers as
  they were (it was out of place): either way that chunk is updated in place at its turn instead,
  as if it had never started.
- **Host memory.** The spares count in the host meter (``StepStats.peak_host_bytes``) and stay
  allocated between steps (fresh pages each step cost more than the update), and the plan gives
  ``update`` nodes to at most as many chunks as half the host's spare room holds.
- **Ctrl-C** waits from the first early update to the end of the step's update, as it waits for
  the update without them (``runtime/interrupts.py``): the step finishes, then it interrupts.

Only the chunks the schedule names are updated early; the rest are updated after the backward,
as before.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Callable

import torch

from pscompile.memory.copies import settle
from pscompile.optim.adamw import grad_norm
from pscompile.runtime.interrupts import deferred_interrupts


def spare_home(store, c: int) -> list[torch.Tensor | None]:
    """Buffers to update host chunk ``c`` of ``store`` into out of place: master, moments and
    (unless the master is the param chunk) a param chunk, from the pools its own come from. A
    param chunk's padding after the state extent is zero, as every param chunk's is: the update
    writes the extent only, and a device slot that held the params later holds the gradients,
    whose norm covers the whole chunk."""
    shared = store.shares_master(c)
    n = store.exp_avg[c].numel()          # (the chunk's state extent)
    master = store.host_param_pool.acquire(zero=True) if shared else store.host_os_pool.acquire(numel=n)
    return [master, store.host_os_pool.acquire(numel=n), store.host_os_pool.acquire(numel=n),
            None if shared else store.host_param_pool.acquire(zero=True)]


def swap_home(store, c: int, bufs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Make ``bufs`` (``spare_home``'s, filled) host chunk ``c``'s master, moments and param chunk;
    returns the ones they replace, in the same order (spares now)."""
    shared = store.shares_master(c)
    old = [store.master[c], store.exp_avg[c], store.exp_avg_sq[c], None if shared else store.host_param[c]]
    store.master[c], store.exp_avg[c], store.exp_avg_sq[c] = bufs[:3]
    store.host_param[c] = bufs[0] if shared else bufs[3]
    return old


def release_spare(store, shared: bool, bufs: list[torch.Tensor | None]) -> None:
    """Give a ``spare_home`` set back to its pools (``shared``: made for a chunk whose master is
    its param chunk)."""
    (store.host_param_pool if shared else store.host_os_pool).release(bufs[0])
    store.host_os_pool.release(bufs[1])
    store.host_os_pool.release(bufs[2])
    if bufs[3] is not None:
        store.host_param_pool.release(bufs[3])


class EarlyUpdates:
    """The early updates of one engine's steps.

    ``update(c, factor, gradless, groups, spare)`` is the engine's out-of-place chunk update, on
    ``store``'s host chunks (spare sets from ``spare_home``, swapped in by ``swap_home``). Spare
    sets stay between steps (as many as the most chunks one step updated early) until ``close``."""

    def __init__(self, adam, store, *, update: Callable):
        self.adam, self._update, self._store = adam, update, store
        self.factor: float | None = None           # the step's guess (None: no early updates this step)
        self.last_count = 0                         # chunks the last committed step updated early
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[int, Future] = {}
        self._norms: dict[int, Future] = {}         # chunk -> its norm, set by its job before it updates
        self._done: dict[int, list] = {}            # chunk -> its filled spare buffers
        self._free: dict[tuple[bool, int], list[list]] = {}   # spare sets kept between steps, by ``_fits``
        self._started = False                       # the step counter was advanced for this step
        self._interrupts: ExitStack | None = None   # SIGINT held back from the first early update on

    # ---- the step's life ---------------------------------------------------------------------
    def begin(self, factor: float | None) -> None:
        """A step starts; ``factor``: the gradient factor if nothing clips (None: none this step)."""
        assert not self._jobs and not self._done and not self._norms, "early updates left over from an earlier step"
        self.factor = factor
        self.last_count = 0

    def submit(self, c: int, landed, gradless: list[tuple[int, int]], groups) -> None:
        """Chunk ``c``'s gradients are final at home once ``landed`` (a copy, or None) has landed:
        start its update on the host thread (main thread: it takes the spares and holds Ctrl-C)."""
        if self.factor is None:
            return
        if not self._started:
            self.adam.begin_step()             # (the main thread does not use the optimizer until ``finish``)
            self._started = True
            self._interrupts = ExitStack()
            self._interrupts.enter_context(deferred_interrupts())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pscompile-early-update")
        free = self._free.get(self._fits(c))
        spare = free.pop() if free else spare_home(self._store, c)     # (kept from the last step: no page faults)
        self._done[c] = spare
        norm = self._norms[c] = Future()
        self._jobs[c] = self._pool.submit(self._run, c, landed, gradless, groups, self.factor, spare, norm)

    def _run(self, c: int, landed, gradless, groups, factor: float, spare: list, norm: Future) -> None:
        try:
            if landed is not None:
                landed.wait_host()
            grad = self._store.grad_home(c)
            for o, n in gradless:                # no gradient: counts as zero (as the step's norm does)
                grad[o:o + n].zero_()
            norm.set_result(grad_norm(grad))
        except BaseException as e:
            norm.set_exception(e)
            raise
        self._update(c, factor, gradless, groups, spare)

    def _fits(self, c: int) -> tuple[bool, int]:
        """Which kept spare sets chunk ``c`` may take: those of chunks whose master is their param
        chunk or not, as ``c``'s is, and whose state extent is ``c``'s. A set of another extent
        would leave its own old values past ``c``'s extent, where the commit makes them ``c``'s
        states and the next fetch carries them into the gradient's padding (and its norm)."""
        return self._store.shares_master(c), self._store.exp_avg[c].numel()

    def norms(self) -> dict[int, Future]:
        """Each early chunk's norm, as its job will set it (before it updates; waiting on one
        raises what its job raised). The step reads a norm from the chunk's device slot where it
        can (``norm_source``), so it need not wait for the gradient to land."""
        return dict(self._norms)

    @property
    def chunks(self) -> frozenset[int]:
        """The chunks updated early this step (submitted), not committed or dropped yet."""
        return frozenset(self._done)

    def wait(self) -> None:
        """Wait for every early update started so far to end (their failures stay for ``commit``)."""
        settle(list(self._jobs.values()))

    def running(self) -> frozenset[int]:
        """The chunks whose early update is still running (a ``commit`` of one would wait)."""
        return frozenset(c for c, job in self._jobs.items() if not job.done())

    @property
    def started(self) -> bool:
        """The step counter is this step's already (an early update began)."""
        return self._started

    def commit(self, c: int) -> bool:
        """Chunk ``c``'s early update stands: once it is done, its spares become its buffers (main
        thread). False if it failed, or had not started (it never will): the chunk's buffers are
        as they were, to update in place."""
        job, spare = self._jobs.pop(c), self._done.pop(c)
        del self._norms[c]
        if job.cancel() or settle([job]):    # (not started yet: the main thread is quicker)
            self._free.setdefault(self._fits(c), []).append(spare)
            return False
        old = swap_home(self._store, c, spare)
        self._free.setdefault(self._fits(c), []).append(old)
        self.last_count += 1
        return True

    def end_step(self) -> None:
        """The step committed: every early update of it stands (``commit`` was called for each)."""
        assert not self._done and not self._jobs, \
            f"early updates of chunks {sorted(self._done)} neither committed nor dropped"
        self._started = False
        self.factor = None

    def undo(self) -> frozenset[int]:
        """Drop every early update of this step (waits for the thread first): the chunks keep their
        buffers, which nothing changed, and the step counter goes back. Harmless when none began."""
        jobs, self._jobs = self._jobs, {}
        settle(list(jobs.values()))
        self._norms.clear()
        dropped = frozenset(self._done)
        for c, spare in self._done.items():
            self._free.setdefault(self._fits(c), []).append(spare)
        self._done.clear()
        if self._started:
            self.adam.undo_step()
            self._started = False
        self.factor = None
        return dropped

    def release_interrupts(self) -> None:
        """The step is over (committed or undone): a Ctrl-C held back since the first early update
        interrupts now. Call it where the step's own recovery is done."""
        stack, self._interrupts = self._interrupts, None
        if stack is not None:
            stack.close()

    def close(self) -> None:
        """Drop what is pending, give the spares back to the store's pools, stop the thread."""
        self.undo()
        for (shared, _), sets in self._free.items():
            for bufs in sets:
                release_spare(self._store, shared, bufs)
        self._free.clear()
        stack, self._interrupts = self._interrupts, None
        if stack is not None:
            try:
                stack.close()
            except BaseException:               # noqa: BLE001 -- closing: nothing left to hold back for
                pass
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
