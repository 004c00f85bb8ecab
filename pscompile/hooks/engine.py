"""Hooks mode: PatrickStar's runtime design on pscompile's chunks, tiers and optimizer.

Module pre-/post-forward hooks access and release the parameters a module owns; backward
accesses a chunk when an autograd node unpacks a saved parameter view (a saved-tensor hook keeps
a reference to the chunk instead of the memory, so the chunk may move between forward and
backward), and a post-accumulate-grad hook writes each gradient into its parameter's own chunk
space. Tensor states (FREE / COMPUTE / HOLD / HOLD_AFTER_FWD / HOLD_AFTER_BWD) decide which
chunks may move.

A trace pass (forward + backward, no update, dropout RNG and buffers restored) keeps only the
chunks in COMPUTE on the device, records every moment's chunk needs and the non-model memory
until the next moment, and so gives the smallest budget the model can run in. Every step after
it replays those moments and evicts the resident chunk used farthest in the future.

ZeRO (a ``ShardedStore``; PatrickStar's Algorithms 1-2): a chunk here is a communication group;
fetching it all-gathers it and evicting it releases the remote shards. A gradient moment needs
the parameter's group, which holds its gradients from the first to the last and is pinned
meanwhile (the trace pins it the same way, so its minimum counts it); when the last one is in,
the group is reduce-scattered to its owners and released.

The hooks themselves and a pass's state are in ``hooks/param_hooks.py``; this module owns what
their accesses do (the moments: fetch, evict), the passes, the plans and the step.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from pscompile.config import AdamW, Config
from pscompile.errors import BudgetError
from pscompile.hooks.access_plan import AccessPlan, Moment
from pscompile.hooks.param_hooks import ParamHooks, PassState
from pscompile.hooks.states import ChunkPlacement, TensorState, chunk_placement
from pscompile.kinds import MomentKind
from pscompile.memory.tiers import Tier
from pscompile.memory.tracker import NonModelTracker
from pscompile.optim.placement import UPDATE_TEMP_BYTES_PER_ELEMENT, first_state_chunks
from pscompile.runtime.rng import rng_state, set_rng_state
from pscompile.runtime.batching import LossFn, extract_loss, signature, to_device
from pscompile.runtime.engine import ChunkEngine, MicroRun
from pscompile.runtime.order import direct_params
from pscompile.stats import StepStats
from pscompile.units import format_bytes

log = logging.getLogger("pscompile.hooks")

__all__ = ["HooksEngine", "BudgetError"]


class HooksEngine(ParamHooks, ChunkEngine):
    def __init__(self, model: nn.Module, batch: Any, *, optimizer: AdamW, config: Config,
                 loss_fn: LossFn | None = None):
        super().__init__(model, batch, optimizer=optimizer, config=config, loss_fn=loss_fn)
        batch = to_device(batch, self.device)
        self._module_params = {name: [self._fqn_of[id(p)] for _, p in own]
                               for name, own in direct_params(model).items()}
        self.states = {fqn: TensorState.HOLD for fqn in self.params}
        self._grad_total = self._grad_counts()

        # -- hooks, trace pass, optimizer-state placement -----------------------------------
        self._pass: PassState | None = None
        self._handles = self._install_hooks()
        self._traces: dict[tuple, AccessPlan] = {}   # batch signature -> forward/backward moments
        self._plans: dict[tuple, AccessPlan] = {}    # ... + optimizer moments for the current placement
        self._eval_plans: dict[tuple, AccessPlan] = {}  # forward-only moments, per batch signature
        self.stats: StepStats | None = None
        try:      # ZeRO: the ranks' first batches may differ in size; their plan is traced together
            self._agree_shapes([batch], "compile")
            self._plan_for(batch)
        except BaseException:
            self.close()          # a failed compile hands the model its weights back
            raise

    # ================================================================ moments
    def _chunks_of(self, fqns) -> tuple[int, ...]:
        out: list[int] = []
        for f in fqns:
            for c in self.layout.entry(f).chunks:
                if c not in out:
                    out.append(c)
        return tuple(out)

    def _moment(self, kind: MomentKind, label: str, need: tuple[int, ...]) -> None:
        """A decision point: make room under the budget and fetch ``need``."""
        ps = self._pass
        if ps is None:
            return
        i = ps.moment
        ps.moment += 1
        store = self.store
        with ps.tracker.paused():
            if ps.tracing:
                if ps.recorded:
                    self._close_window(ps)
                for c in store.resident_chunks():      # keep only what is computing or needed
                    if ps.pins[c] == 0 and c not in need:
                        store.evict(c)
                for c in need:
                    if not store.resident(c):
                        store.fetch(c)
                pinned = {c for c, n in ps.pins.items() if n > 0} | set(need)
                ps.recorded.append(Moment(kind, label, need, 0, len(pinned) * store.param_chunk_bytes,
                                          tuple(sorted(pinned))))
            else:
                plan = ps.plan
                if i >= len(plan.moments) or (plan.moments[i].kind, plan.moments[i].label) != (kind, label):
                    expected = plan.describe(i) if i < len(plan.moments) else "the end of the iteration"
                    raise RuntimeError(
                        f"hooks mode: this iteration left the traced access order at moment {i}: expected "
                        f"{expected}, got ({kind} {label}); data-dependent control flow changes which "
                        "parameters are used; give such batches a different shape or use a fixed path")
                self._make_room(plan, i, need)
                for c in need:
                    if not store.resident(c):
                        store.fetch(c)
        ps.tracker.start_window()
        ps.tracker.sample_now()
        self.store.landed()          # (an NF4 chunk's landing: its workspace counted in that sample)

    def _make_room(self, plan: AccessPlan, i: int, need: tuple[int, ...]) -> None:
        if self.budget is None:
            return
        store = self.store
        capacity = self.budget - plan.moments[i].nonmodel_peak
        incoming = sum(store.param_chunk_bytes for c in need if not store.resident(c))
        fixed = self._fixed_device_bytes() - store.dev_os_pool.bytes_in_use     # (ZeRO: another rank's more)
        while store.device_model_bytes() + fixed + incoming > capacity:
            victims = [c for c in store.resident_chunks()
                       if c not in need and self._evictable(c)]
            if not victims:
                raise BudgetError(
                    f"device_memory={format_bytes(self.budget)} cannot hold {plan.describe(i)}: "
                    f"{format_bytes(store.device_model_bytes() + incoming)} of chunks are pinned and "
                    f"{format_bytes(plan.moments[i].nonmodel_peak)} of non-model data is expected")
            store.evict(plan.farthest(victims, i, dirty={c for c in victims if store.dirty[c]}))

    def _evictable(self, c: int) -> bool:
        if self._pass.pins[c] > 0 or self.store.device_homed(c):   # a device-homed chunk stays once there:
            return False                                          # its gradients have no other home
        states = [self.states[e.fqn] for e, _ in self.layout.chunk_members(c)]
        return chunk_placement(states) is not ChunkPlacement.COMPUTE_DEVICE

    @staticmethod
    def _close_window(ps: PassState) -> None:
        last = ps.recorded[-1]
        ps.recorded[-1] = Moment(last.kind, last.label, last.need, ps.tracker.window_peak, last.pinned_bytes,
                                 last.pinned)

    # ================================================================ passes
    def _new_tracker(self, batch: Any, *, tracing: bool) -> NonModelTracker:
        tracker = NonModelTracker(self.device, self.store.is_model_storage, self.store.device_model_bytes,
                                  exact_windows=tracing)
        for t in torch.utils._pytree.tree_leaves(batch):
            if isinstance(t, torch.Tensor):
                tracker.add_tensor(t)
        for b in self.model.buffers():
            tracker.add_tensor(b)
        tracker.reset_peaks()
        return tracker

    @contextmanager
    def _pass_scope(self, ps: PassState):
        self._pass = ps
        try:
            with ExitStack() as stack:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
                stack.enter_context(ps.tracker)
                yield ps
        finally:
            self._pass = None
            for saved in list(ps.saved):     # (a backward that ran has freed all of them)
                saved.t = None
            for f, p in self.params.items():
                p.data = self._released(p.shape)
                p.grad = None
                self.states[f] = TensorState.HOLD

    def _forward_backward(self, ps: PassState, batch: Any, scale: float) -> tuple[float, float, float]:
        """Run forward and backward inside a pass; returns (loss, forward_s, backward_s)."""
        t0 = time.perf_counter()
        loss = extract_loss(self._run_model(self.model, batch), batch, self.loss_fn)
        loss_value = float(loss.detach().float())
        self.copies.sync_compute()    # (reading the loss waited for compute already)
        for f in self.params:
            self.states[f] = TensorState.HOLD
        t1 = time.perf_counter()
        (loss * scale).backward()     # also at scale 1.0: the trace then holds the same scalar as a
                                      # scaled (fp16) or accumulating (1/k) step
        del loss
        self._end_bwd_node()
        if self.comm is not None:         # groups whose parameters did not all get a gradient
            for c in sorted(c for c, n in ps.grads_left.items() if 0 < n < self._grad_total[c]):
                ps.grads_left[c] = 0
                self._complete_group(ps, c)
        self._moment(MomentKind.BWD_END, "", ())
        if ps.tracing:
            self._close_window(ps)
        self.copies.sync_compute()    # the host next writes homes that backward's fetches read
        return loss_value, t1 - t0, time.perf_counter() - t1

    def _forward_only(self, ps: PassState, batch: Any) -> float:
        with torch.no_grad():
            loss = extract_loss(self._run_model(self.model, batch), batch, self.loss_fn)
            value = float(loss.float())
        self.copies.sync_compute()
        del loss
        self._moment(MomentKind.EVAL_END, "", ())
        if ps.tracing:
            self._close_window(ps)
        return value

    def _evaluate(self, batch: Any) -> tuple[float, int, int]:
        key = self._plan_key(batch)
        plan = self._eval_plans.get(key)
        if plan is None:
            plan = self._trace(batch, train=False)
            self._check_budget(plan)
            self._eval_plans[key] = plan
        ps = PassState(tracing=False, tracker=self._new_tracker(batch, tracing=False), plan=plan)
        if self.disk_prefetch:                # the disk homes' read-ahead
            self.store.expect_fetches(c for m in plan.moments for c in m.need)
        with self._pass_scope(ps):
            value = self._forward_only(ps, batch)
        traffic = self.link.reset()
        return value, ps.tracker.peak_total, traffic.h2d_bytes + traffic.d2h_bytes

    def _plan_key(self, batch: Any, i: int = 0) -> tuple:
        """What the plan of (micro-)batch ``i`` is kept under: its signature, or under ZeRO with
        ranks whose sizes differ this step, one key for the step's shapes on all ranks
        (``RanksShapes.plan_key``). Every rank then traces a new one in the same step, and replays
        the same decisions from the same (agreed) peaks: a plan per rank's own shape, its peaks
        agreed with whatever another rank traced then, evicted (and so all-gathered) differently
        from the other ranks' plans, and the ranks' collectives no longer matched."""
        agreed = self._agreed_shapes()
        return signature(batch) if agreed is None else agreed.plan_key(signature(batch), i)

    def _plan_for(self, batch: Any, sig: tuple | None = None) -> AccessPlan:
        sig = self._plan_key(batch) if sig is None else sig
        if sig not in self._plans:
            self._traces[sig] = self._trace(batch)
            try:
                self._place_optimizer_states()
                self._check_budget(self._plans[sig])
            except BaseException:
                del self._traces[sig]
                self._place_optimizer_states()
                raise
            moments = self._traces[sig].moments
            log.info("pscompile: traced a step of batch %s: %d moments, non-model peak %s; evicting by farthest "
                     "next use under device_memory=%s", signature(batch), len(moments),
                     format_bytes(max((m.nonmodel_peak for m in moments), default=0)),
                     "unlimited" if self.budget is None else format_bytes(self.budget))
        return self._plans[sig]

    def _trace(self, batch: Any, *, train: bool = True) -> AccessPlan:
        """Forward (+ backward when ``train``) keeping only COMPUTE chunks on the device; nothing
        is updated."""
        rng = rng_state(self.device)     # the trace draws no numbers the step after it would see
        buffers = [b.detach().clone() for b in self.model.buffers()]
        ps = PassState(tracing=True, tracker=self._new_tracker(batch, tracing=True), grads_left=self._grad_counts())
        try:
            with self._pass_scope(ps):
                if train:
                    self._forward_backward(ps, batch, 1.0)
                else:
                    self._forward_only(ps, batch)
        finally:
            set_rng_state(self.device, rng)
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers):
                    b.copy_(saved)
            for c in self.store.resident_chunks():
                self.store.evict(c)      # dirty ones (updated on the device) go home first
            self._count_outside_steps()
        moments = tuple(ps.recorded)
        if self.comm is not None:     # every rank replays the same decisions: the same collectives
            peaks = self.comm.agree_max([m.nonmodel_peak for m in moments])
            moments = tuple(Moment(m.kind, m.label, m.need, p, m.pinned_bytes, m.pinned)
                            for m, p in zip(moments, peaks))
        return AccessPlan(moments)

    def _place_optimizer_states(self) -> None:
        """Device-aware placement (``pscompile.optim.placement``) for the largest non-model peak of
        every traced batch shape; rebuilds the plans with the optimizer's moments."""
        peak = max((t.peak_nonmodel for t in self._traces.values()), default=0)
        self.store.place_optimizer_states(first_state_chunks(self.layout, self._device_state_count(peak)))
        self._count_outside_steps()
        opt = self._optimizer_moments()
        self._plans = {sig: AccessPlan(t.moments + opt) for sig, t in self._traces.items()}

    def _optimizer_moments(self) -> tuple[Moment, ...]:
        temp = UPDATE_TEMP_BYTES_PER_ELEMENT * self.layout.chunk_size
        out = []
        for c in range(self.layout.num_chunks):
            if self.store.device_homed(c):
                out.append(Moment(MomentKind.OPT, f"chunk {c}", (c,), temp, self.store.param_chunk_bytes, (c,)))
            elif self.store.os_tier[c] is Tier.DEVICE:     # ZeRO: a shard homed on the device updates there
                out.append(Moment(MomentKind.OPT, f"chunk {c}", (), UPDATE_TEMP_BYTES_PER_ELEMENT * self.store.home_numel, 0))
            else:
                out.append(Moment(MomentKind.OPT, f"chunk {c}", (), 0, 0))
        return tuple(out)

    def _check_budget(self, plan: AccessPlan) -> None:
        if self.budget is None:
            return
        # device-homed chunks stay resident once fetched: count them next to every moment
        homed = [c for c in range(self.layout.num_chunks) if self.store.device_homed(c)]
        need, i = plan.min_device_bytes(homed, self.store.param_chunk_bytes)
        os_bytes = self._fixed_device_bytes()
        if need + os_bytes > self.budget:
            m = plan.moments[i]
            os_note = (f" + {format_bytes(os_bytes)} of optimizer states kept on the device (with the "
                       f"{len(homed)} chunks they update)" if os_bytes else "")
            detail = (f"at {plan.describe(i)}: {format_bytes(m.pinned_bytes)} of parameter chunks in use + "
                      f"{format_bytes(m.nonmodel_peak)} of non-model data{os_note}")
            raise BudgetError(
                f"device_memory={format_bytes(self.budget)} is below the minimum {format_bytes(need + os_bytes)} "
                f"({need + os_bytes} bytes) this model needs {detail}; give device_memory >= {need + os_bytes}, "
                f"a smaller batch or a smaller chunk_size (now {self.layout.chunk_size:,} elements)",
                minimum=need + os_bytes, detail=detail)

    def _mode_title(self) -> str:
        return "hooks mode"

    def _describe_lines(self) -> list[str]:
        n, frozen = self.layout.num_chunks, len(self.layout.frozen_chunks)
        on_dev = sum(t is Tier.DEVICE for t in self.store.os_tier)
        none = f" ({frozen} frozen chunks have none)" if frozen else ""
        return [f"optimizer states: {on_dev}/{n - frozen} chunks on the device, {n - frozen - on_dev} on the host{none}",
                self.describe_tiers()]

    @property
    def min_device_memory(self) -> int:
        """The smallest ``device_memory`` the traced iterations fit in: the largest sum, over
        moments, of the parameter chunks pinned by one moment and that moment's non-model data
        (optimizer states on the host)."""
        return max(p.min_device_bytes()[0] for p in self._traces.values())

    # ================================================================ the step (ChunkEngine.step)
    def _prepare_step(self, batches: list, *, accumulate: bool) -> None:
        self._step_keys = {id(b): self._plan_key(b, i) for i, b in enumerate(batches)}
        for b in batches:          # a new batch shape is traced before anything runs
            self._plan_for(b, self._step_keys[id(b)])

    def _run_micro(self, batch: Any, *, acc: list[torch.Tensor] | None, scale: float, k: int) -> MicroRun:
        plan = self._plans[self._step_keys[id(batch)]]
        ps = PassState(tracing=False, tracker=self._new_tracker(batch, tracing=False), plan=plan, acc=acc,
                   grads_left=self._grad_counts())
        if self.disk_prefetch:                # the disk homes' read-ahead
            self.store.expect_fetches(c for m in plan.moments for c in m.need)
        try:
            with self._pass_scope(ps):
                loss, fwd_s, bwd_s = self._forward_backward(ps, batch, scale / k)
        except BaseException:
            for c in self.store.resident_chunks():    # ZeRO: gradients that never reached their owners
                if self.store.dirty[c] and self.comm is not None:
                    self.store.dirty[c] = False
                    self.store.drop(c)
            if acc is None:
                self._undo_gradients(ps)
            self._count_outside_steps()
            raise
        return MicroRun(loss, ps.tracker, self.link.reset(), fwd_s, bwd_s, frozenset(ps.grad_written), ps)

    def _grad_divisor(self, scale: float, k: int) -> float:
        return scale                    # each micro-batch's loss was scaled by scale / k

    def _update(self, last: MicroRun, written: frozenset[str], divisor: float,
                acc: list[torch.Tensor] | None) -> bool:
        ps: PassState = last.context
        plan = ps.plan
        first_opt = len(plan.moments) - self.layout.num_chunks
        assert ps.moment == first_opt, "optimizer moments out of step with the plan"

        def make_room(c: int) -> None:
            self._moment(MomentKind.OPT, f"chunk {c}", plan.moments[first_opt + c].need)

        self._pass = ps
        if self.comm is not None:         # the update runs on the host shards: gathered groups go
            for c in self.store.resident_chunks():
                self.store.evict(c)
        try:
            with ps.tracker:
                return self._optimizer_step(set(written), divisor, ps.tracker, make_room, grads=acc)
        finally:
            self._pass = None

    def _undo_gradients(self, ps: PassState) -> None:
        """After a failed pass: gradients already written over parameters are undone."""
        touched = {c for f in ps.grad_written for c in self.layout.entry(f).chunks}
        self._undo_all([c in touched for c in range(self.layout.num_chunks)])
        self._count_outside_steps()

