"""Lock-free updating (ANGEL-PTM, Algorithm 2): the optimizer runs on its own host thread.

A step writes its gradients into one of ``staleness + 1`` fp32 gradient buffer sets on the host
and leaves the parameters alone (the accumulation path). Its update -- masters and Adam states
only -- is queued as an ``UpdateJob``. ``LockFreeUpdater`` runs the queued jobs in order, one at a
time, each on a thread of its own, and *publishes* each finished job (the engine casts the new
masters into the compute-dtype chunks) on the compute thread, between steps.

Schedule, for staleness ``s``: at the end of step ``t`` the compute thread queues job ``t``, waits
for the job in flight (job ``t - s``), publishes it, and starts job ``t - s + 1``, which runs
during step ``t + 1``. So the parameters step ``t`` reads hold the updates of steps
``0 .. t - 1 - s`` and none after, exactly (docs/design.md, "Lock-free updating").

The thread touches masters, Adam states and the job's gradient buffers (zeroed as it goes); the
compute thread touches the compute-dtype chunks and the other buffer sets, so the two never
write the same memory. No thread outlives ``join``: each job's thread ends with its job.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from pscompile.config import AdamW


@dataclass(frozen=True)
class UpdateJob:
    """The update of one step's gradients, as the compute thread decided it."""

    step: int                                  # the engine step whose gradients these are
    grads: list[torch.Tensor]                  # the gradient buffer set (fp32, one per chunk)
    chunks: tuple[int, ...]                    # chunks with a gradient: updated, then published
    factor: float                              # what the gradients are multiplied by (clip, mean)
    gradless: tuple[list[tuple[int, int]], ...]  # per chunk of ``chunks``: ranges without a gradient
    groups: tuple[list, ...]                   # per chunk of ``chunks``: its parameter groups
    hps: tuple[AdamW, ...]                     # the groups' hyper-parameters when the step ran


class _Running:
    """One job on its own thread; ``wait`` joins it and re-raises what it raised."""

    def __init__(self, job: UpdateJob, run: Callable[[UpdateJob], None]):
        self.job = job
        self.error: BaseException | None = None

        def body() -> None:
            try:
                run(job)
            except BaseException as e:      # noqa: BLE001 -- handed to the compute thread
                self.error = e
        self.thread = threading.Thread(target=body, name=f"pscompile-update-{job.step}")
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class LockFreeUpdater:
    def __init__(self, *, staleness: int, sets: list[list[torch.Tensor]],
                 run: Callable[[UpdateJob], None], publish: Callable[[UpdateJob], None]):
        """``sets``: ``staleness + 1`` gradient buffer sets, zero. ``run(job)`` updates masters and
        Adam states from ``job.grads`` and zeroes them (on the update thread); ``publish(job)``
        makes the updated masters the parameters (on the compute thread)."""
        assert len(sets) == staleness + 1
        self.staleness = staleness
        self.sets = sets
        self._run = run
        self._publish = publish
        self.pending: deque[UpdateJob] = deque()    # queued, not started
        self._running: _Running | None = None       # started, not yet published
        self.applied = 0                            # jobs published so far

    # ---- the compute thread's side -------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether a job has started and not yet been published (its thread may be working)."""
        return self._running is not None
    def free_set(self) -> list[torch.Tensor]:
        """A gradient buffer set no queued or running job holds (zero)."""
        held = [j.grads for j in self.pending] + ([self._running.job.grads] if self._running else [])
        for s in self.sets:
            if not any(s is h for h in held):
                return s
        raise AssertionError("every gradient buffer set is held: more jobs queued than staleness allows")

    def submit(self, job: UpdateJob) -> None:
        """Queue ``job``; publish the job in flight once it is done, and start the next one when
        ``staleness`` jobs wait (the bound: it waits for no longer)."""
        self.pending.append(job)
        self._finish_running()
        if len(self.pending) >= self.staleness:
            self._running = _Running(self.pending.popleft(), self._run)

    def join(self) -> None:
        """Wait until no update thread runs (a finished job stays unpublished until ``submit``,
        ``drain`` or ``discard``); re-raises the job's failure."""
        if self._running is not None:
            self._running.thread.join()
            if self._running.error is not None:
                raise self._running.error

    def drain(self) -> None:
        """Apply and publish every queued update, here and now (state dicts, close)."""
        self._finish_running()
        while self.pending:
            job = self.pending.popleft()
            self._run(job)
            self._publish(job)
            self.applied += 1

    def discard(self) -> None:
        """Drop every update, queued or in flight (joined, failed or not), their buffers zeroed:
        a state dict is being loaded over all of it."""
        running, self._running = self._running, None
        jobs = list(self.pending) + ([running.job] if running is not None else [])
        self.pending.clear()
        if running is not None:
            running.thread.join()
        for job in jobs:
            for g in job.grads:
                g.zero_()

    @property
    def queued(self) -> int:
        """Steps whose update is not published yet."""
        return len(self.pending) + (self._running is not None)

    def _finish_running(self) -> None:
        running = self._running
        if running is None:
            return
        running.wait()
        self._publish(running.job)
        self._running = None
        self.applied += 1
