"""The optimizer step, chunk by chunk: a mixin of ``ChunkEngine``.

After the forward and backward: the gradient norm over every chunk (and over ranks under ZeRO),
unscaling and clipping, then the AdamW update of each chunk where its optimizer states live (device,
host or disk), as one commit that a failure cannot leave half-done. With lock-free updating the
update is queued to its own thread and applied while the next steps run (``optim/lock_free.py``).
"""

from __future__ import annotations

import bisect
from contextlib import ExitStack
from typing import Callable, Iterable

import torch

from pscompile.memory.disk_homes import DiskAccumulation
from pscompile.memory.tiers import Tier
from pscompile.memory.tracker import NonModelTracker
from pscompile.optim.adamw import clip_coefficient, grad_norm, sum_of_squares
from pscompile.optim.lock_free import UpdateJob
from pscompile import profiling
from pscompile.runtime.interrupts import deferred_interrupts


class ChunkUpdate:
    """Mixin of ``ChunkEngine``: its optimizer step (the module docstring)."""

    def _init_update_state(self, lock_free: bool) -> None:
        """What the step keeps: each chunk's groups (made at first use) and, ``lock_free``, the new
        masters the update thread casts (trainable chunks; publishing swaps them in; zeroed: the
        cast covers the state extent, and the padding after it stays zero)."""
        self._chunk_groups_cache: dict[int, list] = {}
        self._next_params = ([self.store.host_param_pool.acquire(zero=True) if self.store.state_numel(c) else torch.empty(0)
                              for c in range(self.layout.num_chunks)] if lock_free else [])

    def _chunk_groups(self, c: int) -> list[tuple[int, list[tuple[int, int]] | None]]:
        """Chunk ``c``'s parameter groups with their ranges in its home buffers (None: the whole
        chunk, when one group holds all its parameters)."""
        if c not in self._chunk_groups_cache:
            ranges: dict[int, list[tuple[int, int]]] = {}
            for e, p in self.layout.chunk_members(c):
                ranges.setdefault(self.groups.index[e.fqn], []).append((p.chunk_offset, p.numel))
            if len(ranges) <= 1:
                out = [(next(iter(ranges), len(self.adam.hps) - 1), None)]
            else:
                out = [(g, home) for g, rs in ranges.items() if (home := self.store.home_ranges(rs))]
            self._chunk_groups_cache[c] = out
        return self._chunk_groups_cache[c]

    def _gradless_ranges(self, c: int, written: set[str]) -> list[tuple[int, int]]:
        """Ranges of chunk ``c``'s home buffers whose parameters got no gradient this step: the
        "gradless" ranges, which the update leaves as they are. (Not "frozen": that names a chunk
        kind, parameters with ``requires_grad=False``, which have no ranges here at all.)"""
        return self.store.home_ranges([(p.chunk_offset, p.numel) for e, p in self.layout.chunk_members(c)
                                       if e.fqn not in written])

    def _optimizer_step(self, written: set[str], scale: float, tracker: NonModelTracker,
                        before_update: Callable[[int], None] = lambda c: None,
                        grads: list[torch.Tensor] | None = None, *,
                        norm_source: Callable[[int, list], torch.Tensor | None] | None = None,
                        order: Iterable[int] | None = None,
                        after_update: Callable[[int], None] = lambda c: None) -> bool:
        """Unscale, check overflow, clip, then update chunk by chunk where each chunk's optimizer
        states live (``before_update(c)`` runs first, e.g. to make room; ``after_update(c)`` after,
        for every chunk). ``written`` names the
        parameters whose gradients are in their chunks, or in ``grads`` (fp32 host chunks that
        accumulated several micro-batches; the param chunks then still hold the parameters).
        ``norm_source(c, gradless ranges)``: where chunk ``c``'s gradient is read for the norm, if not
        from ``store.gradient`` (None: from there); ``order``: the chunks in the order to update
        (each once; the updates are independent, so any order gives the same bits).
        Returns True if the step was skipped."""
        store, n = self.store, self.layout.num_chunks
        has_grad = [store.owns(c) and any(e.fqn in written for e, _ in self.layout.chunk_members(c))
                    for c in range(n)]
        self._norm = None                    # (this step's, from _unscale_and_clip)
        if self.updater is not None:
            return self._queue_update(written, scale, tracker, has_grad, before_update, grads)
        try:
            return self._guarded_step(written, scale, tracker, before_update, grads, norm_source, order,
                                      after_update, has_grad)
        finally:
            self.early.release_interrupts()   # a Ctrl-C held back since the first early update

    def _guarded_step(self, written: set[str], scale: float, tracker: NonModelTracker,
                      before_update: Callable[[int], None], grads: list[torch.Tensor] | None,
                      norm_source: Callable[[int, list], torch.Tensor | None] | None, order: Iterable[int] | None,
                      after_update: Callable[[int], None], has_grad: list[bool]) -> bool:
        """``_optimizer_step`` after its lock-free branch: the norm (with the early updates' chunks
        undone if the step's factor is not the one they assumed), then the commit."""
        store, n = self.store, self.layout.num_chunks
        undo = has_grad if grads is None else [False] * n     # accumulation left the params intact
        try:
            early = self.early.norms()        # the chunks updated in the backward, with their norms
            factor = self._unscale_and_clip(written, scale, tracker, has_grad, undo, grads, norm_source, early)
        except BaseException:
            self.early.undo()                 # (a job's norm failed, or anything else: none stands)
            self._undo_all(undo)              # the chunks hold gradients: back to the parameters
            raise
        if factor is None:
            return True
        self._clipped_last = factor != 1.0 / scale
        if early and factor != self.early.factor:   # clipped: the early updates assumed otherwise
            self.early.undo()
        # The commit: masters and Adam states change chunk by chunk and cannot be undone. Ctrl-C
        # waits until the update is done; any other failure leaves a partial update, which the
        # engine refuses to train on or save until a checkpoint is loaded.
        with deferred_interrupts():
            try:
                self._apply_update(written, factor, tracker, has_grad, before_update, grads, order, after_update)
            except BaseException as e:
                self.early.undo()                 # (a partial update: the engine refuses to go on)
                try:
                    store.settle_disk()           # no transfer left running, staging buffers back
                except BaseException:             # noqa: BLE001 -- the first failure is the one raised
                    pass
                self._mark_update_failed(e)
                raise
        return False

    # ================================================================ updates in the backward
    def _early_update(self, c: int, factor: float, gradless: list[tuple[int, int]], groups, spare: list) -> None:
        """On the early-update thread: chunk ``c``'s update from its gradient at home, as
        ``_update_chunk`` does it for a host home, into ``spare`` (``runtime/early_update.spare_home``)."""
        store = self.store
        with profiling.maybe(f"update chunk {c} (early)"):
            self.adam.update_chunk_out(spare[3], store.master[c], store.exp_avg[c], store.exp_avg_sq[c],
                                       tuple(spare[:3]), grad=store.grad_home(c), grad_factor=factor, gradless=gradless,
                                       groups=groups)

    def _start_update(self, c: int, landed, written: set[str]) -> None:
        """An ``update`` node: chunk ``c``'s gradients are final at home once ``landed`` has."""
        if self.store.os_tier[c] is Tier.HOST and any(e.fqn in written for e, _ in self.layout.chunk_members(c)):
            self.early.submit(c, landed, self._gradless_ranges(c, written), self._chunk_groups(c))

    # ================================================================ lock-free updating
    def _queue_update(self, written: set[str], scale: float, tracker: NonModelTracker, has_grad: list[bool],
                      before_update: Callable[[int], None], grads: list[torch.Tensor]) -> bool:
        """Lock-free: unscale, check and clip here (the step fails or skips before anything is
        queued), then queue the update of ``grads`` (a buffer set) and let the updater publish
        and start what the staleness bound says. Returns True for a skipped step."""
        n = self.layout.num_chunks
        factor = self._unscale_and_clip(written, scale, tracker, has_grad, [False] * n, grads)
        for c in range(n):
            before_update(c)                 # the mode's bookkeeping (hooks: its optimizer moments)
        if factor is None:
            for g in grads:
                g.zero_()
            return True
        chunks = tuple(c for c in range(n) if has_grad[c])
        job = UpdateJob(step=self.steps_run, grads=grads, chunks=chunks, factor=factor,
                        gradless=tuple(self._gradless_ranges(c, written) for c in chunks),
                        groups=tuple(self._chunk_groups(c) for c in chunks), hps=tuple(self.adam.hps))
        with deferred_interrupts(), tracker.paused():     # queued and the bound kept, or neither
            try:
                self.updater.submit(job)
            except BaseException as e:
                self._mark_update_failed(e)
                raise
        return False

    def _run_update_job(self, job: UpdateJob) -> None:
        """On the update thread: AdamW on masters and Adam states from the job's gradients, which
        it zeroes (the buffer set is free again); the compute-dtype chunks are not touched. A disk
        home's states are staged (the next disk chunk's reads queued while this one updates) and
        written back; only this thread uses the disk tier while a job runs (the compute thread
        reads states only after ``_apply_queued_updates``)."""
        store = self.store
        on_disk = [c for c in job.chunks if store.os_tier[c] is Tier.DISK]
        self.adam.begin_step()
        try:
            for c, gradless, groups in zip(job.chunks, job.gradless, job.groups):
                disk = store.os_tier[c] is Tier.DISK
                if disk:
                    k = bisect.bisect_right(on_disk, c)
                    if k < len(on_disk) and self.disk_prefetch:
                        store.stage(on_disk[k])
                    store.master[c], store.exp_avg[c], store.exp_avg_sq[c] = store.disk.take(c)
                # the next params get the new masters' cast in the same pass (the compiled kernel)
                self.adam.update_chunk(self._next_params[c], store.master[c], store.exp_avg[c], store.exp_avg_sq[c],
                                       grad_factor=job.factor, gradless=gradless, grad=job.grads[c], groups=groups,
                                       hps=job.hps, background=True)
                job.grads[c].zero_()
                if disk:
                    store.disk.write_back(c, [store.master[c], store.exp_avg[c], store.exp_avg_sq[c]])
                    store.master[c] = store.exp_avg[c] = store.exp_avg_sq[c] = torch.empty(0)
        finally:
            if on_disk:
                store.settle_disk()

    def _publish_update(self, job: UpdateJob) -> None:
        """On the compute thread, between steps: the parameters the update thread cast from the
        new masters take the place of the old (swapped; the device copies of the old ones are
        dropped), whose buffers take the next update's."""
        store, nxt = self.store, self._next_params
        for c in job.chunks:
            store.drop(c)
            store.host_param[c], nxt[c] = nxt[c], store.host_param[c]

    def _abandon_step(self, grads: list[torch.Tensor]) -> None:
        """A lock-free step failed: its gradients are dropped and no update thread is left
        running (the one in flight finishes; it is published at the next step)."""
        for g in grads:
            g.zero_()
        try:
            self.updater.join()
        except BaseException as e:          # noqa: BLE001 -- the step's own failure is the one raised
            self._mark_update_failed(e)

    def _mark_update_failed(self, e: BaseException) -> None:
        self._stop(f"this engine failed inside the optimizer update ({type(e).__name__}: {e}); its "
                   "weights and optimizer states are partly updated: load a checkpoint "
                   "(pscompile.load or load_state_dict) before training or saving again")

    def _apply_queued_updates(self) -> None:
        """Lock-free: apply every queued update now (state dicts and ``close`` see them all)."""
        if self.updater is None or self._stopped():
            return
        try:
            with deferred_interrupts():
                self.updater.drain()
        except BaseException as e:
            self._mark_update_failed(e)
            raise

    @property
    def queued_updates(self) -> int:
        """Lock-free: steps whose update is not in the parameters yet (0 otherwise)."""
        return 0 if self.updater is None else self.updater.queued

    def _unscale_and_clip(self, written: set[str], scale: float, tracker: NonModelTracker, has_grad: list[bool],
                          undo: list[bool], grads: list[torch.Tensor] | None,
                          norm_source: Callable[[int, list], torch.Tensor | None] | None = None,
                          early: dict | None = None) -> float | None:
        """The gradient norm over every rank; on inf/NaN, undo and skip (or raise). Returns the
        factor the gradients are multiplied by in the update, None for a skipped step. ``early``:
        the chunks updated in the backward, with futures of their norms (computed there, from the
        same values): read from the device slot instead where ``norm_source`` has it."""
        store, n = self.store, self.layout.num_chunks
        norms: list[torch.Tensor] = []
        for c in range(n):
            if not has_grad[c]:
                continue
            gradless = self._gradless_ranges(c, written)
            if early and c in early:
                buf = norm_source(c, gradless) if norm_source is not None and not gradless else None
                norms.append(grad_norm(buf) if buf is not None else early[c].result())
                continue
            buf = norm_source(c, gradless) if norm_source is not None else None
            if buf is not None:                              # (a device copy of it, no gradless ranges)
                norms.append(grad_norm(buf))
                continue
            buf = store.gradient(c) if grads is None else _acc_of(grads, c)
            with ExitStack() as stack:
                if grads is not None or not store.resident(c):
                    stack.enter_context(tracker.paused())    # host-side work is not device memory
                for o, k in gradless:                              # no gradient: count as zero
                    buf[o:o + k].zero_()
                if gradless and grads is None and store.resident(c):
                    store.dirty[c] = True
                norms.append(grad_norm(buf))
                if grads is None and not store.resident(c):
                    store.close_home(c, dirty=bool(gradless))      # (a disk home: opened by gradient)
                if grads is not None:
                    _done_with_acc(grads, c, dirty=bool(gradless))
        with tracker.paused():
            sq = sum_of_squares(norms)
        if self.comm is not None:          # the global norm: every rank's shards
            sq = self.comm.sum(sq)
        inv_scale = 1.0 / scale
        total_norm = (sq ** 0.5) * inv_scale
        self._norm = total_norm            # (StepStats.grad_norm)
        found_inf = not (sq < float("inf"))     # also catches NaN
        if found_inf:
            if self.scaler is None and not self.config.skip_nonfinite:
                raise FloatingPointError(
                    f"the gradients contain inf/NaN in {self.dtype} without loss scaling (loss scaling is "
                    "used with float16 only); the update was not applied (Config(skip_nonfinite=True) skips "
                    "such steps instead)")
            self._undo_all(undo)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            return None
        return inv_scale * clip_coefficient(total_norm, self.hp.max_grad_norm) if self.hp.max_grad_norm \
            else inv_scale

    def _apply_update(self, written: set[str], factor: float, tracker: NonModelTracker, has_grad: list[bool],
                      before_update: Callable[[int], None], grads: list[torch.Tensor] | None,
                      order: Iterable[int] | None = None,
                      after_update: Callable[[int], None] = lambda c: None) -> None:
        store, n = self.store, self.layout.num_chunks
        on_disk = [c for c in range(n) if has_grad[c] and store.os_tier[c] is Tier.DISK]
        early = self.early.chunks                              # updated in the backward already
        if not self.early.started:
            self.adam.begin_step()
        for c in (range(n) if order is None else order):
            before_update(c)
            if c in early and self.early.commit(c):             # its new buffers take the old ones' place
                store.mark_updated(c)
            elif has_grad[c]:                                   # (else nothing to update here; an early
                                                                # update that failed: in place instead)
                self._update_chunk(c, written, factor, tracker, grads, on_disk)
            after_update(c)
        self.early.end_step()
        store.settle_disk()

    def _update_chunk(self, c: int, written: set[str], factor: float, tracker: NonModelTracker,
                      grads: list[torch.Tensor] | None, on_disk: list[int]) -> None:
        """AdamW on chunk ``c`` where its optimizer states live (``on_disk``: the disk homes that
        get gradients, in order; the next one is staged while this one updates)."""
        store = self.store
        with ExitStack() as stack:
            stack.enter_context(profiling.maybe(f"update chunk {c}"))
            if store.os_tier[c] is not Tier.DEVICE:
                stack.enter_context(tracker.paused())       # the update runs on the host
            buf = store.bring_to_os_tier(c)
            k = bisect.bisect_right(on_disk, c)              # the next disk chunk after this one
            if k < len(on_disk) and self.disk_prefetch:
                store.stage(on_disk[k])                     # the disk reads it while this one updates
            grad = None
            if grads is not None:
                grad = _acc_of(grads, c)
                if store.os_tier[c] is Tier.DEVICE:       # the accumulated gradient comes over
                    host, grad = grad[:store.master[c].numel()], torch.empty_like(store.master[c])
                    # waited on the host: the host zeroes (or refills) grads[c] once the step ends
                    self.copies.submit(grad, host, "h2d").wait_host()
            if store.shares_master(c):          # the new master is the new param chunk: no cast back
                buf, grad = None, buf if grad is None else grad
            self.adam.update_chunk(buf, store.master[c], store.exp_avg[c], store.exp_avg_sq[c],
                                   grad_factor=factor, gradless=self._gradless_ranges(c, written), grad=grad,
                                   groups=self._chunk_groups(c))
            store.mark_updated(c)
            if grads is not None:
                _done_with_acc(grads, c)


def _acc_of(grads, c: int) -> torch.Tensor:
    """Chunk ``c``'s gradient accumulation buffer (on disk: opened, ``_done_with_acc`` after)."""
    return grads.open(c) if isinstance(grads, DiskAccumulation) else grads[c]


def _done_with_acc(grads, c: int, *, dirty: bool = False) -> None:
    if isinstance(grads, DiskAccumulation):
        grads.close(c, dirty=dirty)
