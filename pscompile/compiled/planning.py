"""Compiled mode's schedules: captured, planned, re-planned and picked, a mixin of ``CompiledEngine``.

The engine plans nothing itself: every schedule comes from ``pscompile.graph.pipeline``
(``capture_and_analyze`` once per capture, ``build_schedule`` per budget and curve). This mixin keeps
them per ``ScheduleKey`` (run kind, train()/eval(), batch signature), with warm variants for loops
that start from the chunks the last run left, and places the optimizer states the plan keeps on the
device.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.ranges import ShapeRanges
from pscompile.errors import BudgetError
from pscompile.dims import Declared, DynamicShapes
from pscompile.graph.analysis import analyze_at_bound, guards_refuse_bound, range_refusal
from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.graph.minimum import minimum_budget, program_headroom
from pscompile.runtime.batching import digest, signature
from pscompile.graph.pipeline import (AnalyzedGraph, DeviceMemory, Scheduled, capture_and_analyze, choose_activations,
                                      PlanRequest, engine_layout, gather_bytes, layout_candidates, plan_at_budget,
                                      plan_within, regather)
from pscompile.kinds import Activations, RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.model_bytes import fetch_bytes
from pscompile.memory.tiers import Tier
from pscompile.optim.placement import first_state_chunks, update_overlaps_next_step
from pscompile.runtime.params import ModelParams
from pscompile.units import format_bytes

log = logging.getLogger("pscompile.compiled")


class CompiledPlanning:
    """Mixin of ``CompiledEngine``: its schedules (the module docstring)."""

    def _choose_layout(self, mp: ModelParams, batch: Any) -> ChunkLayout:
        """With ``chunk_size="auto"`` and a budget, two layouts may differ: the paged one (least
        waste, at most an eighth of the budget; tensors larger than a chunk span several) and the
        one keeping every tensor whole. Each reader of a spanning tensor holds a gathered copy of it,
        so at a tight budget the whole one may fit where the paged one does not, and with room the
        paged one usually moves less. ``pipeline.engine_layout`` plans both on the first batch's
        capture (kept for the first schedule) and takes the one that moves the fewest bytes."""
        self._first_capture: tuple[CaptureKey, AnalyzedGraph, dict] | None = None
        variants: dict[tuple, AnalyzedGraph] = {}      # its activation rewrites, made once (one serves every layout)

        def analyze() -> AnalyzedGraph:
            key = self._key(batch, RunKind.TRAIN)
            if ShapeRanges.is_ranged(key.batch):      # sizes named up front: the range's capture, at its bound
                ranged = self._range_analysis(key, batch, mp.params)
                if ranged is not None:
                    return ranged
            analyzed = capture_and_analyze(self.model, batch, params=mp.params, loss_fn=self.loss_fn,
                                           dtype=self.dtype, sources=self._sources)
            self._first_capture = (ScheduleKey(RunKind.TRAIN, self.model.training, signature(batch)).capture,
                                   analyzed, variants)
            return analyzed
        layout, self.layout_choices = engine_layout(mp, self.config, self.budget, analyze=analyze, world=self.world,
                                                    per_chunk=self.per_chunk, variants=variants,
                                                    kept=self.choices_kept)
        return self._agreed_layout(mp, layout)

    def _agreed_layout(self, mp: ModelParams, layout: ChunkLayout) -> ChunkLayout:
        """ZeRO: one layout on every rank. Each weighs the candidates on its own first batch, and
        ranks whose first batches differ in size may prefer others (chunks of other sizes: the
        collectives no longer match); all take the largest chunk any rank picked (of the candidates,
        the same on every rank: the budget is agreed), as ``pick_layout`` prefers larger chunks."""
        if self.comm is None:
            return layout
        size = self.comm.agree_max([layout.chunk_size])[0]
        if size == layout.chunk_size:
            return layout
        headroom = program_headroom(self.budget, self.config)     # (weighed as ``engine_layout`` weighs them)
        return next(c for weighed in dict.fromkeys((self.budget and self.budget - headroom, self.budget))
                    for c in layout_candidates(mp, self.config, weighed, world=self.world, per_chunk=self.per_chunk)
                    if c.chunk_size == size)

    def _key(self, batch: Any, kind: RunKind) -> ScheduleKey:
        """The key ``batch`` runs under: its signature, or the ranged one its family shares once
        its sizes changed (``compiled/ranges.py``)."""
        sig = signature(batch)
        self._declare(batch, sig)
        return ScheduleKey(RunKind(kind), self.model.training, self.ranges.key(sig))

    def _declare(self, batch: Any, sig: tuple) -> None:
        """``Config.dynamic``'s sizes named up front (``pscompile/dims.py``), resolved at a family's
        first batch. A spec that does not fit the engine's first batch raises ValueError; a later
        family of another structure (an evaluation batch without labels) keeps automatic dynamic."""
        spec = self.config.dynamic
        if not isinstance(spec, DynamicShapes) or self.world > 1 or not self.ranges.enabled \
                or self.ranges.declared(sig):
            return
        try:
            declared = spec.resolve(batch)
        except ValueError as e:
            if not self.ranges.declared():
                raise
            log.info("pscompile: sizes %s are not described by Config.dynamic (%s): automatic dynamic for them",
                     sig[1:], e)
            declared = Declared((), ())
        self.ranges.declare(sig, declared)

    def _schedule_for(self, batch: Any, kind: RunKind) -> Scheduled:
        """The (cold) schedule of ``batch`` for ``kind``; captured and planned on first use."""
        key = self._key(batch, kind)
        if ShapeRanges.is_ranged(key.batch):
            if not self._admitted(key, batch):
                return self._schedule_for(batch, kind)      # refused: now keyed by its own signature
            self._replan_range(key)
            try:
                return self._planned_for(key, batch)
            except BudgetError as e:     # the range's bound needs more than this budget: a plan per shape
                log.info("pscompile: sizes %s run under a plan of their own: the range's bound does not fit (%s)",
                         signature(batch)[1:], str(e)[:300])
                self.ranges.set_symbolic(key.capture, None)
                self.book.drop_analysis(key.capture)
                self._zero_fallback(f"the range's bound does not fit ({str(e)[:300]})", e)
                self.ranges.refuse(signature(batch))
                return self._schedule_for(batch, kind)
        return self._planned_for(key, batch)

    def _planned_for(self, key: ScheduleKey, batch: Any) -> Scheduled:
        """``key``'s schedule, captured (for ``batch``) and planned on first use."""
        book = self.book
        sched = book.cold(key)
        if sched is not None:
            return sched
        analyzed = book.analysis(key.capture)
        if analyzed is None and ShapeRanges.is_ranged(key.batch):
            bound = self.ranges.bound(key.batch)
            self.ranges.plan_at(key.capture, bound)
            analyzed = analyze_at_bound(self.ranges.symbolic(key.capture), bound,
                                        gathers=gather_bytes(self.layout, self.dtype))
            book.bases.note(key.capture, analyzed)
            analyzed = self._choose_activations(analyzed, None, key.capture)
            book.set_analysis(key.capture, analyzed)
        if analyzed is None:
            first, self._first_capture = self._first_capture, None
            variants = None
            if first is not None and first[0] == key.capture:      # captured to choose the layout
                analyzed, variants = regather(first[1], gather_bytes(self.layout, self.dtype)), first[2]
            else:
                analyzed = capture_and_analyze(self.model, batch, params=self.params, loss_fn=self.loss_fn,
                                               dtype=self.dtype, backward=key.kind.backward,
                                               gathers=gather_bytes(self.layout, self.dtype),
                                               sources=self._sources)
            book.bases.note(key.capture, analyzed)
            analyzed = self._choose_activations(analyzed, variants, key.capture)
            book.set_analysis(key.capture, analyzed)
        self._install_restored(key.capture)
        measured = book.life(key.capture).curve
        nonmodel = measured if measured is not None else analyzed.nonmodel
        self._fit_optimizer_states(max(nonmodel))
        sched = self._plan(analyzed, nonmodel, kind=key.kind, measured=measured is not None, cap=key.capture)
        book.set_cold(key, sched)
        return sched

    def _choose_activations(self, analyzed: AnalyzedGraph, variants: dict | None,
                            cap: CaptureKey | None = None) -> AnalyzedGraph:
        """The activation plan of a capture, chosen for the budget less the program's headroom
        (``_program_headroom``) where the choice fits there, else for the whole budget; where
        Inductor's program needed room the plan did not leave (``lowering._rechoose_activations``),
        less that room too."""
        if self.budget is None:
            return self._activations_for(None, analyzed, variants)
        budget = self.budget - self.book.bases.reserve(cap)
        headroom = self._program_headroom(cap)
        if headroom:
            chosen = self._activations_for(budget - headroom, analyzed, variants)
            least = minimum_budget(chosen, self.layout, nonmodel=chosen.nonmodel, slot_bytes=self.store.param_chunk_bytes,
                                   world=self.world, device_homes=self.min_device_homes,
                                   state_bytes=self.store.os_chunk_bytes).nbytes
            if least <= budget - headroom:
                return chosen
        return self._activations_for(budget, analyzed, variants)

    def _activations_for(self, budget: int | None, analyzed: AnalyzedGraph, variants: dict | None) -> AnalyzedGraph:
        return choose_activations(analyzed, self.layout, policy=self.config.activations, budget=budget,
                                  slot_bytes=self.store.param_chunk_bytes, world=self.world,
                                  device_homes=self.min_device_homes, state_bytes=self.store.os_chunk_bytes,
                                  rates=self.rates if self.config.activations == Activations.AUTO else None,
                                  host_room=self.host_room, variants=variants, kept=self.choices_kept)

    def _admitted(self, key: ScheduleKey, batch: Any) -> bool:
        """Whether the range's symbolic capture (made now if it is the first) runs ``batch``: it
        traced (a model may refuse symbolic sizes), kept every dynamic size a symbol, its memory
        grows with the sizes (``dynamic.monotone``) and its shape guards hold for ``batch``. A
        batch refused is keyed by its own signature from then on, with an INFO line saying why; one
        admitted is not checked again (evaluating the guards costs milliseconds, a step)."""
        sig = signature(batch)
        why = None if self.ranges.admitted(key.capture, sig) else self._refusal(key, batch)
        if self.comm is not None:
            why = self._agreed_refusal(key, why)
        if why is None:
            self.ranges.admit(key.capture, sig)
            return True
        log.info("pscompile: sizes %s run under a plan of their own: %s", sig[1:], why)
        self.ranges.refuse(sig)
        return False

    def _refusal(self, key: ScheduleKey, batch: Any) -> str | None:
        """Why the range's symbolic capture (made now if it is the first) does not run ``batch``,
        or None when it does (``_admitted``)."""
        sym = self.ranges.symbolic(key.capture)
        if not self.ranges.tried(key.capture):
            sym, why = self._capture_range(key, batch)
            self.ranges.set_symbolic(key.capture, sym)
            if why is not None:
                return why
        if sym is None:
            return "the range was refused before (an INFO line above says why)"
        offset = sym.num_params + len(sym.buffer_fqns)
        if not sym.symbolic.admits([t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)], offset):
            return "its shape guards (" + ", ".join(str(g.expr) for g in sym.symbolic.shape_env.guards) + ") refuse it"
        return None

    def _agreed_refusal(self, key: ScheduleKey, why: str | None) -> str | None:
        """ZeRO: the admission every rank takes (``_admitted``), so all plan the same. One all-reduce
        per ranged run (every rank reaches it in the same step: the ranges are fed agreed sizes only),
        of any rank's refusal and a digest of each rank's symbolic graph (each captured on its own
        batch: a graph that differs, a size traced into it, would plan other collectives). A refusal
        holds on every rank for the range from then on. Ranks whose sizes differ this step then
        cannot fall back to a plan per shape (``_zero_fallback``)."""
        sym = self.ranges.symbolic(key.capture)
        code = digest(sym.gm.code) if sym is not None else 0
        refused, high, low = self.comm.agree_max([int(why is not None or sym is None), code, -code])
        if not refused and high == -low:
            return None
        why = why or ("another rank's symbolic capture refused its batch" if refused else
                      "the ranks' symbolic captures differ (each traced its own batch)")
        self.ranges.set_symbolic(key.capture, None)
        self.book.drop_analysis(key.capture)
        self._zero_fallback(why, None)
        return why

    def _zero_fallback(self, why: str, cause: BaseException | None) -> None:
        """ZeRO, a range refused (``why``): a plan per shape serves only a step whose ranks pass the
        same shapes; else a ``ValueError`` on every rank (they agree on all it depends on)."""
        agreed = self._agreed_shapes() if self.comm is not None else None
        if agreed is None or agreed.uniform:
            return
        raise ValueError(f"under ZeRO the ranks' batches differ in size this step (from {list(agreed.low)} to "
                         f"{list(agreed.high)}), and the one symbolic capture that would serve them all is refused: "
                         f"{why}. Pad every rank's batch to one length (a fixed max_length, or the longest over "
                         "the ranks), or make the sizes the model's code reads traceable") from cause

    def _check_batch(self, batch: Any, micro: list | None, call: str = "step") -> None:
        """``ChunkEngine._check_batch``; ZeRO: the sizes the ranks agreed on feed the ranges
        (``ShapeRanges.agree``) before any key is made from this rank's own batch."""
        super()._check_batch(batch, micro, call)
        if self.comm is not None:
            agreed = self._agreed_shapes()
            for low, high in zip(agreed.low, agreed.high):
                self.ranges.agree(low, high)

    def _range_analysis(self, key: ScheduleKey, batch: Any, params) -> AnalyzedGraph | None:
        """A declared range's capture analyzed at its bound, for choosing the layout before the
        engine has its parameters (None, with an INFO line, when the symbolic capture is refused)."""
        sym, why = self._capture_range(key, batch, params)
        self.ranges.set_symbolic(key.capture, sym)
        if sym is None:
            log.info("pscompile: sizes %s run under a plan of their own: %s", signature(batch)[1:], why)
            return None
        return analyze_at_bound(sym, self.ranges.bound(key.batch))

    def _capture_range(self, key: ScheduleKey, batch: Any, params=None) -> tuple[CapturedGraph | None, str | None]:
        dims = self.ranges.dims(key.batch)
        try:
            sym = capture_joint(self.model, batch, params=dict(self.params if params is None else params),
                                loss_fn=self.loss_fn, param_dtype=self.dtype, backward=key.kind.backward,
                                loss_scale=self.dtype == torch.float16, sources=self._sources, dynamic=dims)
        except Exception as e:  # noqa: BLE001 - the model's code may need plain sizes: a plan per shape then
            return None, f"the capture with symbolic sizes failed ({type(e).__name__}: {str(e)[:200]})"
        why = range_refusal(sym)
        if why is not None:
            return None, why
        log.info("pscompile: sizes change at %s: one symbolic capture serves them (%s)",
                 ", ".join(f"batch tensor {i} dim {d}" for i, d in dims), sym.summary)
        refusing = guards_refuse_bound(sym, self.ranges.bound(key.batch))
        if refusing is not None and self.ranges.declared(signature(batch)):
            log.warning("pscompile: the range's bound %s breaks the model's traced shape guards (%s): a Dim's max "
                        "(Config.dynamic) above what the model runs plans room no batch uses; lower it",
                        list(self.ranges.bound(key.batch)), refusing)
        return sym, None

    def _replan_range(self, key: ScheduleKey) -> None:
        """A ranged batch above the bound its capture was planned for: every schedule of that
        capture is made again for the new bound (the symbolic capture stays)."""
        planned = self.ranges.planned(key.capture)
        bound = self.ranges.bound(key.batch)
        if planned is None or planned == bound:
            return
        over = self.ranges.over_declared(key.batch)
        if over:
            log.warning("pscompile: a batch above the sizes named up front, %s: planning again for %s (a larger "
                        "max plans for it from the first batch)", "; ".join(over), list(bound))
        else:
            log.info("pscompile: a batch above the planned sizes %s: planning again for %s", list(planned), list(bound))
        self._drop_schedules(key.capture)
        self.book.drop_analysis(key.capture)
        self.ranges.unplan(key.capture)
        self.book.life(key.capture).refresh()
        self.book.bases.forget(key.capture)

    def _device_memory(self, budget: int | None) -> DeviceMemory:
        """The device as the pipeline sees it now, for a plan made at ``budget``."""
        on_dev = frozenset(c for c in range(self.layout.num_chunks) if self.store.os_tier[c] is Tier.DEVICE)
        # (one rank: such chunks stay in their slots; ZeRO: only this rank's shard lives there)
        return DeviceMemory(budget, self.store.param_chunk_bytes, on_dev if self.world == 1 else frozenset(),
                            self._fixed_device_bytes(), world=self.world, rank=self.rank,
                            per_chunk=self.per_chunk, device_shards=on_dev if self.world > 1 else frozenset(),
                            param_disk=frozenset(self.param_disk_chunks),
                            fetch_bytes=fetch_bytes(self.layout, self.store.param_chunk_bytes))

    def _program_headroom(self, cap: CaptureKey | None = None) -> int:
        """Device bytes ``cap``'s schedules leave free for what Inductor's program holds beyond the
        measured curve (``minimum.program_headroom``); none once ``cap`` runs as compiled eager."""
        life = self.book.known_life(cap)
        return 0 if life is not None and life.eager_reason else program_headroom(self.budget, self.config)

    def _plan(self, analyzed: AnalyzedGraph, nonmodel: tuple[int, ...], *, kind: RunKind, measured: bool,
              start: dict[int, int] | None = None, cap: CaptureKey | None = None) -> Scheduled:
        """``analyzed``'s schedule for ``kind``, within the budget less the program's headroom where
        it fits (``pipeline.plan_within``)."""
        return plan_within(lambda b: self._plan_at(b, analyzed, nonmodel, kind, measured, start), self.budget,
                           self._program_headroom(cap))

    def _plan_at(self, budget: int | None, analyzed: AnalyzedGraph, nonmodel: tuple[int, ...], kind: RunKind,
                 measured: bool, start: dict[int, int] | None) -> Scheduled:
        request = PlanRequest(budget, self.dtype, kind, self.world, self.rank, self.per_chunk,
                              planner=self.config.planner, measured=measured, start=start,
                              lookahead=self._overlaps_update and measured,
                              early_updates=self._early_update_limit if kind is RunKind.TRAIN else 0,
                              param_disk_chunks=len(self.param_disk_chunks))
        sched = plan_at_budget(analyzed, self.layout, request, nonmodel=nonmodel, memory=self._device_memory(budget))
        log.info("pscompile: planned the %s schedule (%s non-model memory, peak %s)%s in %d device slots: %d fetches, "
                 "%s in and %s out per run%s", kind.value, "measured" if measured else "estimated",
                 format_bytes(max(nonmodel, default=0)),
                 "" if budget == self.budget else f" for {format_bytes(budget)} ({self.budget - budget} bytes kept "
                 "for Inductor's buffers)", sched.plan.num_slots, sched.plan.num_fetches,
                 format_bytes(sched.plan.h2d_bytes), format_bytes(sched.plan.d2h_bytes),
                 "" if start is None else " (warm: starting from the chunks the last run left)")
        ahead = sched.lookahead.fetches if sched.lookahead is not None else ()
        self.moves.ensure(sched.plan, extra=1 + max((k for _, k in ahead), default=-1))   # (and the lookahead's)
        self._count_outside_steps()
        return sched

    @property
    def _early_update_limit(self) -> int:
        """How many chunks' updates may start in the backward (``plan_early_updates``): one rank,
        synchronous updates, no disk tier, ``Config.overlap_update``; as many as half the host's
        spare room (``host_room``) holds undo copies of (master, moments and gradient buffer)."""
        if (not self.config.overlap_update or self.world > 1 or self.updater is not None or self.param_disk_chunks
                or any(t is Tier.DISK for t in self.store.os_tier)):
            return 0
        undo_bytes = self.store.os_chunk_bytes + self.store.home_numel * 4
        return min(self.layout.num_chunks, self.host_room // (2 * undo_bytes))

    @property
    def _overlaps_update(self) -> bool:
        """``optim.placement.update_overlaps_next_step`` for this engine."""
        return update_overlaps_next_step(world=self.world, lock_free=self.updater is not None,
                                         loss_scaled=self.scaler is not None,
                                         disk_states=any(t is Tier.DISK for t in self.store.os_tier))

    def _fit_optimizer_states(self, peak_nonmodel: int) -> None:
        """Device-aware optimizer-state placement (``pscompile.optim.placement``) for the largest
        non-model peak of every schedule and ``peak_nonmodel`` (a schedule about to be planned).
        The first placement decides; later ones only move states off the device (a measurement,
        or a new batch shape, that leaves less margin), and schedules planned for the old placement
        are planned again."""
        peak = max([peak_nonmodel] + [max(self.book.cold(k).nonmodel) for k in self.book.keys()])
        count = self._device_state_count(peak + self._program_headroom())
        now = sum(t is Tier.DEVICE for t in self.store.os_tier)
        if self._os_placed and count >= now:
            return
        self._place_states(set(first_state_chunks(self.layout, count)))
        self._os_placed = True

    def _place_states(self, on_device: set[int]) -> None:
        """Put the optimizer states of ``on_device``'s chunks on the device, the others on the
        host, and plan every schedule again for the new placement."""
        # states leaving the device: between steps a param chunk is its master's cast, which goes
        # home with them (place_optimizer_states)
        self.moves.release_where(on_device.__contains__)
        self.store.place_optimizer_states(on_device)
        self._count_outside_steps()
        for key in self.book.keys():                    # planned for the old placement
            s = self.book.cold(key)
            self._replan(key, s.nonmodel, measured=s.measured)

    def _replan_capture(self, cap: CaptureKey, nonmodel: tuple[int, ...] | None, *, measured: bool) -> None:
        """Every re-plan of a capture comes here: each of its schedules is planned again with
        ``nonmodel`` (None: each with its own curve), after an event of its life
        (``capture_life.LIFE``: measured, raised for Inductor's buffers, restored, forgotten,
        refreshed) or a change of the device it plans for (optimizer states moved)."""
        for key in self.book.keys(cap):
            self._replan(key, nonmodel if nonmodel is not None else self.book.cold(key).nonmodel, measured=measured)

    def _replan(self, key: ScheduleKey, nonmodel: tuple[int, ...], *, measured: bool) -> Scheduled:
        old = self.book.cold(key)            # (replaced in place: the keys keep their order)
        for s in (old, self.book.drop_warm(key)):
            if s is not None:
                self._forget_lowering(s.gm)
        new = self._plan(self.book.analysis(key.capture), nonmodel, kind=old.kind, measured=measured, cap=key.capture)
        self.book.set_cold(key, new)
        return new

    def _drop_schedules(self, cap: CaptureKey) -> None:
        """``cap``'s schedules go, with what was made for them (planned again at the next use)."""
        for key in self.book.keys(cap):
            for s in self.book.drop_schedules(key):
                self._forget_lowering(s.gm)

    def _warm_of(self, key: ScheduleKey) -> Scheduled | None:
        """The warm variant of ``key``'s measured schedule (planned now if needed), None if it has
        none: the schedule a loop's steady runs take (``_runnable``)."""
        book = self.book
        cold, warm = book.cold(key), book.warm(key)
        start = None
        if warm is None and cold.measured and len(cold.plan.final) > len(cold.os_device):
            start = dict(cold.plan.final)
        elif warm is None and cold.measured and cold.lookahead is not None and cold.lookahead.fetches:
            start = dict(cold.lookahead.fetches)   # a training step that starts with the chunks the previous one fetched
        if start is not None:
            warm = self._plan(book.analysis(key.capture), cold.nonmodel, kind=cold.kind, measured=True, start=start,
                              cap=key.capture)
            book.set_warm(key, warm)
        return warm

    def _runnable(self, batch: Any, kind: RunKind) -> tuple[ScheduleKey, Scheduled]:
        """The schedule to run now: the warm variant when the chunks resident now are the ones it
        starts from (the previous run of this loop left them), else the cold one, after dropping
        leftover chunks (clean: no bytes move)."""
        cold = self._schedule_for(batch, kind)
        key = self._key(batch, kind)
        if self._lower_if_due(key):       # measured: its program is compiled now, before this run
            cold = self._schedule_for(batch, kind)
        warm = self._warm_of(key)
        if warm is not None and self.moves.residency() == dict(warm.plan.initial):
            self.moves.warm_start(warm.plan)     # (nothing to fetch; a chunk it waits for that another run
            return key, warm                # left in its slot has landed)
        self.moves.settle()
        if warm is not None and self.world == 1 and self._wants_program(key, warm):
            self.moves.warm_start(warm.plan)     # one program per loop: every run takes the warm schedule
            return key, warm
        return key, cold
