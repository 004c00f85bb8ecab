"""Compiled mode's executors: how a schedule is run, and the plan checked against its regions.

``RegionLowering`` is the part of ``CompiledEngine`` that owns the executors of its schedules
(``compiled/executor.py``) and what their regions allocate inside:

- a measuring run (the first of a schedule) runs node by node; a measured schedule runs compute
  regions, compiled by Inductor (shared through one ``RegionCache``) or as eager graph code;
- the first run of a region executor is probed (``compiled/probe.py``): compiled regions are
  checked for the layouts they receive and, where their allocations are not measured yet, run as
  eager code while their real inputs are kept; after the step they are measured on those inputs;
- a region's measured peak goes into the plan (``probe.region_curve``): where the plan does not
  hold it, the capture is planned again (a few rounds), and where the budget cannot hold it, the
  capture runs node by node;
- a region that cannot be compiled, fails on its real inputs or would receive another layout runs
  as eager code from then on (``_fall_back``).

The engine calls ``_init_lowering`` in its constructor, ``_executor_for`` to run a schedule,
``_settle_probe`` after a probing run, ``_lower`` after planning, and ``_forget_lowering`` for a
schedule that is replaced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import fx

from pscompile.compiled.executor import Executor
from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.probe import Allocation, Probe, measure, region_curve, warn_fallback
from pscompile.compiled.regions import RegionCache
from pscompile.errors import BudgetError
from pscompile.kinds import Backend

log = logging.getLogger("pscompile.compiled")

if TYPE_CHECKING:
    from pscompile.graph.pipeline import Scheduled

__all__ = ["RegionLowering"]

_MAX_REGION_ROUNDS = 3


class RegionLowering:
    """Mixin of ``CompiledEngine`` (see the module doc); it relies on the engine's ``config``,
    ``budget``, ``comm``, ``device``, ``_schedules``, ``_captures``, ``_measured``, ``_node_curves``,
    ``_replan`` and ``_fit_optimizer_states``."""

    def _init_lowering(self) -> None:
        self._region_cache = RegionCache()         # compiled regions, shared by every schedule
        self._allocs: dict[str, Allocation] = {}   # region key -> what its compiled code allocates (probe.py)
        # (every table below is keyed by a schedule's graph itself: a graph module hashes by identity,
        # and the table keeps it alive until _forget_lowering drops it with its schedule)
        # scheduled gm -> the probe of its executor's first run(s): layouts checked; with
        # ``eager_all``, compiled regions run as eager code and unmeasured ones keep their inputs
        self._probing: dict[fx.GraphModule, Probe] = {}
        self._executors: dict[fx.GraphModule, Executor] = {}   # scheduled gm -> its executor
        # scheduled gm -> region index -> bytes the region allocates beyond what is live when it
        # starts: a compiled region's measured once with the profiler (the tracker cannot see inside),
        # an eager region's by the tracker, operator by operator, in the first run of its executor
        self._region_extra: dict[fx.GraphModule, dict[int, int]] = {}
        self._unlearned: set[fx.GraphModule] = set()        # eager regions not yet measured
        self._tails: dict[fx.GraphModule, frozenset[fx.Node]] = {}   # its memory nodes after the last compute
        self._region_rounds: dict[CaptureKey, int] = {}   # re-plans for measured region peaks
        self._pending_curves: dict[CaptureKey, tuple[int, ...]] = {}   # region-raised curves to plan with
        self._node_by_node: set[CaptureKey] = set()       # captures whose regions did not fit: run eagerly
        # captures whose compiled regions no longer defer their gradient stores (``_stop_deferring``)
        self._unfolded: set[CaptureKey] = set()

    def _forget_lowering(self, gm: fx.GraphModule) -> None:
        """Drop what was made for the schedule of ``gm`` (it is being replaced)."""
        for made in (self._executors, self._region_extra, self._probing, self._tails):
            made.pop(gm, None)
        self._unlearned.discard(gm)

    def _executor_for(self, key: ScheduleKey, sched: Scheduled) -> Executor:
        """The executor of a schedule: node by node for a measuring run; regions between memory
        nodes for a measured schedule, compiled by Inductor (``backend="inductor"``, compiled once
        per schedule and shared through the engine's RegionCache) or run as eager graph code
        (``backend="eager"``, and Inductor's regions too small to compile). The first run of a
        region executor is probed (``compiled/probe.py``): where every compiled region's
        allocation is known, the plan is checked against them now and that run only checks the
        layouts its compiled regions receive; otherwise the plan is checked for the regions as
        eager code (which that run runs them as), and they are measured on their real inputs, and
        the plan checked again, after it (``_settle_probe``)."""
        ex = self._executors.get(sched.gm)
        if ex is None:
            regions = sched.measured and key.capture not in self._node_by_node
            # eager regions read parameters as the graph does (no region is shared, so none is lifted
            # out: a gathered parameter is made where the node-by-node measurement saw it made)
            # and run the gradient stores into device slots themselves (``_mark_stored``); compiled
            # regions leave them to the executor, right after the region, with no budget only (a
            # gradient then lives to its region's end; under a budget the plan gave it no room)
            eager = self.config.backend == Backend.EAGER
            ex = Executor(sched.gm, split="regions" if regions else "nodes", backend=self.config.backend,
                          cache=self._region_cache, lift_params=not eager,
                          fold_stores=regions and key.capture not in self._unfolded)
            self._executors[sched.gm] = ex
            if regions:
                compiled = ex.compiled_regions()
                known = all(r.key in self._allocs for r in compiled)
                if compiled:
                    self._probing[sched.gm] = Probe(self._allocs.__contains__, eager_all=not known)
                ex = self._check_region_curve(key, sched, ex, {} if known else None)
        return ex

    def _check_region_curve(self, key: ScheduleKey, sched: Scheduled, ex: Executor,
                            learned: dict[int, int] | None) -> Executor:
        """Plan check of a region executor. ``learned`` None: before a probing run, which runs
        every region as eager code (only the parameters gathered before a region can need more
        than the node-by-node curve). Else its compiled regions' allocations are all known: if the
        plan holds them, keep ``ex`` (its regions' inside bytes, sampled at their boundaries, in
        ``_region_extra``; ``learned``: its eager regions' too, else they learn them in its next
        run). Where the plan does not hold them, the curve they need is planned next and the
        schedule runs node by node until then."""
        compiled = ex.compiled_regions() if learned is not None else []
        extra = {r.index: self._allocs[r.key].peak for r in compiled}
        excess = {r.index: self._allocs[r.key].excess for r in compiled}
        curve = region_curve(ex.regions, extra, excess, sched.nonmodel, sched.captured,
                             self._node_curves.get(key.capture, sched.nonmodel))
        if self.comm is not None:      # the ranks decide together (their plans must match)
            agreed = self.comm.agree_max(curve if curve is not None else sched.nonmodel)
            curve = agreed if agreed != tuple(sched.nonmodel) else None
        if curve is not None:          # the regions need more than this plan gives them: run node
            self._pending_curves[key.capture] = curve     # by node until it is planned again
            self._probing.pop(sched.gm, None)
            ex = self._executors[sched.gm] = Executor(sched.gm, split="nodes")
            return ex
        if learned is None:
            return ex
        # steps after measurement sample at region boundaries only (no dispatch mode): eager
        # regions learn what they allocate inside in their first run (_run_graph)
        if learned:
            extra.update({r.index: v for r in ex.regions if not ex.is_compiled(r)
                          and (v := learned.get(r.index)) is not None})
        self._region_extra[sched.gm] = extra
        if not learned:
            self._unlearned.add(sched.gm)
        return ex

    def _settle_probe(self, key: ScheduleKey, sched: Scheduled, probe: Probe) -> None:
        """After an executor's first run: regions that failed (the layout check, or the measurement)
        become eager code. After a probing run (``eager_all``; between steps, no activation live)
        the compiled regions are measured on the real inputs it kept, and the plan is checked
        against the measurements (``_check_region_curve``)."""
        if self._probing.get(sched.gm) is not probe:
            return
        del self._probing[sched.gm]
        allocs, failed = measure(probe.saved, self.device) if probe.eager_all else ({}, {})
        self._allocs.update(allocs)
        for stage, problems in (("checking its inputs' layout", probe.mismatched),
                                ("running it on its real inputs", failed)):
            for region_key, (r, why) in problems.items():
                self._fall_back(region_key, r, stage, why)
        ex = self._executors.get(sched.gm)
        if not probe.eager_all or ex is None or ex.split != "regions":
            return                      # (without eager_all the plan was checked when ex was made)
        self._check_region_curve(key, sched, ex, probe.learned)
        self._lower(key)

    def _fall_back(self, region_key: str, r, stage: str, why: str) -> None:
        """Regions of ``region_key`` run as eager graph code in every executor from now on."""
        warn_fallback(r, stage, why)
        self._region_cache.fail((self.config.backend, region_key), f"{stage}: {why}")
        for gm, ex in list(self._executors.items()):
            changed = ex.fall_back(region_key, f"{stage}: {why}") if ex.split == "regions" else []
            known = self._region_extra.get(gm)
            if changed and known is not None:     # what they allocate as eager code: learned in the next run
                for r in changed:
                    known.pop(r.index, None)
                self._unlearned.add(gm)

    def _lower(self, key: ScheduleKey) -> None:
        """Make the executor of ``key``'s schedule now, not inside the next step, and plan again
        while its compiled regions need more than planned (a few rounds)."""
        for _ in range(_MAX_REGION_ROUNDS + 1):
            if key not in self._schedules:
                return
            self._executor_for(key, self._schedules[key])
            if not self._pending_curves:
                return
            self._adopt_pending_curves()

    def _adopt_pending_curves(self) -> None:
        while self._pending_curves:
            cap, curve = self._pending_curves.popitem()
            self._adopt_region_curve(cap, curve)

    def _run_node_by_node(self, cap: CaptureKey, why: str) -> None:
        """From now on ``cap`` runs node by node (the measured curve holds there), which is several
        times slower than compiled regions: said at WARNING on the ``pscompile`` logger."""
        if cap not in self._node_by_node:
            log.warning("pscompile: %s runs node by node from now on, several times slower than compiled regions: "
                        "%s (a larger device_memory lets it run compiled)", cap.token[:80], why)
        self._node_by_node.add(cap)

    def _stop_deferring(self, cap: CaptureKey) -> bool:
        """Under a budget, compiled regions run the gradient stores into slots after them (the
        gradients live to the region's end). Where the budget cannot hold that, ``cap``'s stores
        cut its regions again and it is planned afresh from the node-by-node curve, before the
        last resort of running node by node. False if its stores already cut (or nothing defers)."""
        if self.budget is None or self.config.backend == Backend.EAGER or cap in self._unfolded:
            return False
        log.info("pscompile: %s: gradient stores cut the compiled regions again (the budget cannot hold "
                 "gradients kept to their region's end)", cap.token[:80])
        self._unfolded.add(cap)
        self._region_rounds[cap] = 0
        self._measured[cap] = curve = self._node_curves.get(cap, self._measured.get(cap))
        self._fit_optimizer_states(max(curve))
        for other in list(self._schedules):
            if other.capture == cap:
                self._replan(other, curve, measured=True)
        return True

    def _adopt_region_curve(self, cap: CaptureKey, curve: tuple[int, ...]) -> None:
        """Compiled regions allocate more inside than the node-by-node measurement saw: plan every
        schedule of the capture again with the region peaks (a few rounds, since new plans cut new
        regions). If the budget cannot hold them, the capture runs node by node, where the measured
        curve holds."""
        rounds = self._region_rounds.get(cap, 0)
        if rounds >= _MAX_REGION_ROUNDS:
            if not self._stop_deferring(cap):
                self._run_node_by_node(cap, f"its compiled regions still needed more memory after {rounds} re-plans")
            return
        self._region_rounds[cap] = rounds + 1
        previous = self._measured.get(cap)
        try:
            self._measured[cap] = curve
            self._fit_optimizer_states(max(curve))
            for other in list(self._schedules):
                if other.capture == cap:
                    self._replan(other, curve, measured=True)
        except BudgetError:
            self._measured[cap] = previous
            if self._stop_deferring(cap):
                return
            self._run_node_by_node(cap, "the budget cannot hold what its compiled regions allocate")
            for other in list(self._schedules):
                if other.capture == cap:
                    self._replan(other, previous, measured=True)
