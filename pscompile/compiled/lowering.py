"""Compiled mode's executors: how a schedule is run, and the plan checked against its regions.

``RegionLowering`` is the part of ``CompiledEngine`` that owns the executors of its schedules
(``compiled/executor.py``) and what their regions allocate inside:

- a measuring run (the first of a schedule) runs node by node; a measured schedule runs compute
  regions, compiled by Inductor (shared through one ``RegionCache``) or as eager graph code;
- the first run of a region executor is probed (``compiled/probe.py``): compiled regions are
  checked for the layouts they receive and, where their allocations are not measured yet, run as
  eager code while their real inputs are kept; after the step they are measured on those inputs;
- the plan is checked against each region's measured peak (``probe.over_plan``): the plan stays
  (it is planned from the node-by-node measurement, and moves what compiled eager moves), and a
  region that does not fit it is cut where its peak is into smaller regions, which are measured
  in their next run (a few rounds); after the last round, the operators of a region that still
  does not fit run alone as eager code, one by one, which the plan holds by construction (it was
  planned with their node-by-node measurement);
- a region that cannot be compiled, fails on its real inputs or would receive another layout runs
  as eager code from then on (``_fall_back``);
- a range's schedule (``compiled/ranges.py``) has its regions compiled once for symbolic sizes
  (``compiled/inductor.py``): its first run at each new batch shape checks their layouts
  (``_check_sizes``), and its probing run measures them at the range's bound.

The engine calls ``_init_lowering`` in its constructor, ``_executor_for`` to run a schedule,
``_settle_probe`` after a probing run, ``_lower`` after planning, and ``_forget_lowering`` for a
schedule that is replaced.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from torch import fx

from pscompile.compiled.executor import Executor
from pscompile.compiled.inductor import grown
from pscompile.compiled.keys import CaptureKey, ScheduleKey
from pscompile.compiled.probe import (Allocation, Probe, Snapshot, made_bytes, measure, over_plan, region_peaks,
                                      room_of, warn_fallback)
from pscompile.compiled.program import is_compute_op
from pscompile.compiled.ranges import ShapeRanges
from pscompile.compiled.regions import RegionCache, region_source
from pscompile.graph.dynamic import symbolic_values
from pscompile.graph.meta import get
from pscompile.runtime.batching import signature
from pscompile.kinds import Backend

log = logging.getLogger("pscompile.compiled")

if TYPE_CHECKING:
    from pscompile.graph.pipeline import Scheduled

__all__ = ["RegionLowering"]

_MAX_REGION_ROUNDS = 3     # rounds of cuts per capture; then what still does not fit runs alone as eager code
# operators cut apart from the rest of a region that does not fit: compiled, attention is a library
# call whose inputs Inductor first copies to the strides it requires (8 KiB more than eager code for
# the tiny GPT's, docs/inductor.md), so a region that holds one rarely fits where its eager code does
_APART = {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")}


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
        self._region_rounds: dict[CaptureKey, int] = {}   # rounds of cuts for measured region peaks (the most
        self._gm_rounds: dict[fx.GraphModule, int] = {}   # of any of its schedules'; per schedule here)
        self._node_by_node: set[CaptureKey] = set()       # last resort (never expected): run node by node
        # regions cut to fit the budget, per capture (captured node indices, ``src_index``): a region
        # also ends before each node of ``_cuts``; each node of ``_solo`` runs alone as eager code
        self._cuts: dict[CaptureKey, set[int]] = {}
        self._solo: dict[CaptureKey, set[int]] = {}
        # region key -> bytes its measurement would need beyond the room between steps (not measured:
        # its regions are cut like those that do not fit the plan)
        self._unmeasured: dict[str, int] = {}
        self._symvals: dict[fx.GraphModule, list | None] = {}   # a range's schedule -> its nodes' symbolic values
        self._sizes_run: dict[fx.GraphModule, set[tuple]] = {}  # and the batch signatures it ran (checked)

    def _forget_lowering(self, gm: fx.GraphModule) -> None:
        """Drop what was made for the schedule of ``gm`` (it is being replaced)."""
        for made in (self._executors, self._region_extra, self._probing, self._tails, self._gm_rounds, self._symvals,
                     self._sizes_run):
            made.pop(gm, None)
        self._unlearned.discard(gm)

    def _executor_for(self, key: ScheduleKey, sched: Scheduled) -> Executor:
        """The executor of a schedule: node by node for a measuring run; regions between memory
        nodes for a measured schedule, compiled by Inductor (``backend="inductor"``, compiled once
        per schedule and shared through the engine's RegionCache) or run as eager graph code
        (``backend="eager"``, and Inductor's regions too small to compile). The first run of a
        region executor with compiled regions is a probing run (``compiled/probe.py``): every
        region runs as eager code (the plan is checked for that first: only the parameters gathered
        before a region can need more than the node-by-node curve there), the bytes live at each
        region's start are sampled, compiled regions not measured yet are measured on the real
        inputs it kept, and the plan is checked against all of it after the run (``_settle_probe``)."""
        ex = self._executors.get(sched.gm)
        if ex is None:
            regions = sched.measured and key.capture not in self._node_by_node
            ex = self._executors[sched.gm] = self._new_executor(key, sched, regions)
            if regions:
                ex = self._probe_or_check(key, sched, ex)
        return ex

    def _new_executor(self, key: ScheduleKey, sched: Scheduled, regions: bool) -> Executor:
        """Eager regions read parameters as the graph does (no region is shared, so none is lifted
        out: a gathered parameter is made where the node-by-node measurement saw it made) and run
        the gradient stores into device slots themselves (``_mark_stored``); compiled regions leave
        them to the executor, right after the region (a gradient then lives to its region's end,
        which the region's measured peak includes). ``_cuts`` and ``_solo`` cut regions to fit.
        Every region with an operator is compiled (``min_fusible=0``): under a budget, memory nodes
        cut many regions of one or two operators, and run as eager code they were most of the
        step's operators (docs/inductor.md)."""
        ranged = ShapeRanges.is_ranged(key.batch)
        symbolic = self._symbolic_values(key, sched) if ranged and regions else None
        backend = Backend.EAGER if ranged and symbolic is None else self.config.backend
        eager = backend == Backend.EAGER
        cap = key.capture
        return Executor(sched.gm, split="regions" if regions else "nodes", backend=backend,
                        cache=self._region_cache, lift_params=not eager, fold_stores=regions, min_fusible=0,
                        cuts=frozenset(self._cuts.get(cap, ())), solo=frozenset(self._solo.get(cap, ())),
                        any_sizes=ranged, symbolic=symbolic)

    def _symbolic_values(self, key: ScheduleKey, sched: Scheduled) -> list | None:
        """A range's schedule: the symbolic value of each of its nodes (``dynamic.symbolic_values``),
        for regions compiled once for every length; None with the eager backend, or if the schedule
        cannot be propagated with symbolic sizes (its regions then run as eager graph code)."""
        if self.config.backend == Backend.EAGER:
            return None
        if sched.gm not in self._symvals:
            captured = self._symbolic.get(key.capture)
            try:
                tail = captured.symbolic.inputs[captured.num_params:]
                self._symvals[sched.gm] = symbolic_values(sched.gm, tail, self.device)
            except Exception as e:  # noqa: BLE001 - eager regions then, as for the eager backend
                log.info("pscompile: the range's regions run as eager graph code: its schedule did not propagate "
                         "with symbolic sizes (%s: %s)", type(e).__name__, str(e)[:200])
                self._symvals[sched.gm] = None
        return self._symvals[sched.gm]

    def _probe_or_check(self, key: ScheduleKey, sched: Scheduled, ex: Executor) -> Executor:
        """A new region executor: probed in its first run if it has compiled regions (what is live
        where each region starts depends on the schedule: another schedule of the same capture
        reloads activations and gathers parameters elsewhere), else checked now."""
        if ex.compiled_regions():
            self._probing[sched.gm] = Probe(self._allocs.__contains__, eager_all=True)
            return self._check_regions(key, sched, ex, None)
        return self._check_regions(key, sched, ex, {})

    def _check_regions(self, key: ScheduleKey, sched: Scheduled, ex: Executor, learned: dict[int, int] | None,
                       starts: dict[int, int] | None = None) -> Executor:
        """Plan check of a region executor (``probe.over_plan``). ``learned`` None: before a probing
        run, which runs every region as eager code. Else after it (or for an executor without
        compiled regions): what its regions allocate inside (compiled: measured, ``_allocs``; eager:
        ``learned``, by the tracker in that run) and the bytes live at their starts (``starts``). The
        room a region has is the same whether it was probed or not (a resumed engine decides as the
        uninterrupted one did).
        If the plan holds every region's peak, keep ``ex`` (the inside bytes are sampled at the
        region boundaries from now on, ``_region_extra``; eager regions not learned yet learn them
        in its next run). Where it does not, the plan stays and the regions beyond it are cut
        (``_cut_regions``) in a new executor, probed in its first run; after ``_MAX_REGION_ROUNDS``
        rounds the operators of the regions still beyond it run alone as eager code, which the
        plan holds (it was planned with at least their node-by-node measurement)."""
        cap = key.capture
        measured = [r for r in ex.compiled_regions() if r.key in self._allocs] if learned is not None else []
        inside = {r.index: self._allocs[r.key].peak for r in measured}
        excess = {r.index: self._allocs[r.key].excess for r in measured}
        inside.update({r.index: v for r in ex.regions if not ex.is_compiled(r)
                       and (v := (learned or {}).get(r.index)) is not None})
        peaks = region_peaks(ex.regions, inside, excess, starts, sched.captured,
                             self._node_curves.get(cap, sched.nonmodel))
        if self.budget is None:
            over = {}
        else:                          # (the room every region has for sure)
            floor = self.budget - sched.plan.num_slots * self.store.param_chunk_bytes - self._fixed_device_bytes()
            # the room the plan leaves each region (verify_schedule's replay: the budget less the slots, the
            # states on the device and the gradients still copying there), the same probed or not
            rooms = {r.index: x for r in ex.regions if (x := room_of(r)) is not None}
            over = over_plan(peaks, sched.nonmodel, rooms, floor)
            if learned is not None:    # an eager region ran within the budget in the probing run, as it will
                over = {i: v for i, v in over.items() if ex.is_compiled(ex.regions[i])}   # from now on
                over.update({r.index: self._unmeasured[r.key] for r in ex.compiled_regions()   # (too large
                             if r.key not in self._allocs and r.key in self._unmeasured})     # to measure)
        if self.comm is not None:      # the ranks decide together (their plans and regions must match)
            agreed = self.comm.agree_max([over.get(r.index, 0) for r in ex.regions])
            over = {i: v for i, v in enumerate(agreed) if v > 0}
        if not over:
            if learned is not None:
                self._region_extra[sched.gm] = inside
                if any(not ex.is_compiled(r) and r.index not in inside for r in ex.regions):
                    self._unlearned.add(sched.gm)
                if ex.compiled_regions():  # its first compiled run checks every layout: a compiled region's
                    # outputs may have other strides than the eager code's the probing run passed on
                    self._probing[sched.gm] = Probe(self._allocs.__contains__, eager_all=False)
            return ex
        self._probing.pop(sched.gm, None)
        rounds = self._gm_rounds.get(sched.gm, 0)
        if learned is not None:        # (a round is a measurement; cuts before a probing run cost none)
            rounds = self._gm_rounds[sched.gm] = rounds + 1
            self._region_rounds[cap] = max(self._region_rounds.get(cap, 0), rounds)
        if not self._cut_regions(cap, ex, over, alone=rounds > _MAX_REGION_ROUNDS):
            self._run_node_by_node(cap, "its regions still did not fit after their operators ran alone")
            ex = self._executors[sched.gm] = Executor(sched.gm, split="nodes")
            return ex
        ex = self._executors[sched.gm] = self._new_executor(key, sched, True)   # the plan stays
        return self._probe_or_check(key, sched, ex)

    def _cut_regions(self, cap: CaptureKey, ex: Executor, over: dict[int, int], *, alone: bool) -> bool:
        """Cut each region of ``over`` for ``cap``'s next executors around the operator where its
        node-by-node measurement peaks (compiled regions allocate most where their eager code does)
        and its attention operators (``_APART``), and in half, so each part holds less; a region of one operator, or every region with ``alone``, has its
        operators run alone as eager code (said at WARNING, naming the region). False if nothing
        changed."""
        cuts, solo = self._cuts.setdefault(cap, set()), self._solo.setdefault(cap, set())
        before = (len(cuts), len(solo))
        node_curve = self._node_curves.get(cap) or ()
        for index in over:
            r = ex.regions[index]
            ops = [i for n in r.nodes if is_compute_op(n) and (i := get(n, "src_index")) is not None]
            if alone or len(ops) <= 1:           # every node alone (views too: their gathered inputs
                nodes = [i for n in r.nodes if (i := get(n, "src_index")) is not None]   # made at each)
                if ops and not solo.issuperset(ops):
                    log.warning("pscompile: %d operator(s) of region %d (%s) run alone as eager code: compiled, "
                                "they need %d bytes more than the budget leaves there", len(ops), r.index,
                                region_source(r), over[index])
                solo.update(nodes)
                continue
            peak = max(ops, key=lambda i: node_curve[i] if i < len(node_curve) else 0)
            apart = {ops.index(peak)} | {ops.index(i) for n in r.nodes if n.target in _APART
                                         and (i := get(n, "src_index")) in ops}
            cuts.update(ops[k] for at in apart for k in (at, at + 1) if 0 < k < len(ops))
            cuts.add(ops[len(ops) // 2])          # and in half: a few rounds leave no large region
        return (len(cuts), len(solo)) != before

    def _settle_measure(self, probe: Probe, tracker) -> tuple[dict, dict, dict]:
        """Measure the regions a probing run kept the inputs of (``probe.measure``), between steps
        with only the chunks that live on the device there (the others, clean, are dropped: no
        bytes move); the measurement's device bytes count in the step's peak (``tracker``). Returns
        the allocations, the keys that failed, and those whose measurement would not fit (``_measurable``)."""
        if not probe.saved:
            return {}, {}, {}
        self._settle()
        saved, unfit = self._measurable({k: (r, grown(r, snaps, Snapshot))     # a range's: at the bound
                                         for k, (r, snaps) in probe.saved.items()})
        found = measure(saved, self.device)
        if tracker is not None:
            tracker.note(found.footprint, self._model_bytes())
        return found.allocs, found.failed, unfit

    def _measurable(self, probe_saved: dict) -> tuple[dict, dict]:
        """The saved regions (``Probe.saved``) whose measurement fits the budget now: the copies of their inputs plus
        every value their graph makes (``probe.made_bytes``: the most their code can allocate)
        beside the chunks on the device; the others (a region that reads a large parameter
        holds a copy of it there, beside the chunk itself in a real run: Mixtral's stacked experts)
        are not measured (key -> (region, bytes over)): they are cut like regions that do not fit."""
        if self.budget is None:
            return probe_saved, {}
        room = self.budget - self._model_bytes()
        saved, unfit = {}, {}
        for key, (r, snaps) in probe_saved.items():
            need = sum(s.nbytes for s in snaps if isinstance(s, Snapshot)) + made_bytes(r)
            if need > room:
                unfit[key] = (r, need - room)
            else:
                saved[key] = (r, snaps)
        return saved, unfit

    def _settle_probe(self, key: ScheduleKey, sched: Scheduled, probe: Probe, tracker=None) -> None:
        """After an executor's first run: regions that failed (the layout check, or the measurement)
        become eager code. After a probing run (``eager_all``; between steps, no activation live)
        the compiled regions are measured on the real inputs it kept, and the plan is checked
        against the measurements (``_check_region_curve``)."""
        if self._probing.get(sched.gm) is not probe:
            return
        del self._probing[sched.gm]
        allocs, failed, unfit = self._settle_measure(probe, tracker) if probe.eager_all else ({}, {}, {})
        self._allocs.update(allocs)
        self._unmeasured.update({k: need for k, (_, need) in unfit.items()})
        for stage, problems in (("checking its inputs' layout", probe.mismatched),
                                ("running it on its real inputs", failed)):
            for region_key, (r, why) in problems.items():
                self._fall_back(region_key, r, stage, why)
        ex = self._executors.get(sched.gm)
        if not probe.eager_all or ex is None or ex.split != "regions":
            return
        if ShapeRanges.is_ranged(key.batch):   # measured at one length: a range is checked at its bound (its
            self._check_regions(key, sched, ex, {}, None)   # compiled regions measured there, the rest
        else:                                               # by the node-by-node curve, made at least the bound's)
            self._check_regions(key, sched, ex, probe.learned, probe.starts)
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

    def _check_sizes(self, key: ScheduleKey, sched: Scheduled, ex: Executor, batch) -> None:
        """A range's compiled regions run on new sizes (``batch``'s signature): the run
        checks the layout of every compiled region's inputs first (``Probe`` without ``eager_all``;
        a region given another layout than its symbols say runs as eager code from then on)."""
        if not ShapeRanges.is_ranged(key.batch) or not ex.compiled_regions() or sched.gm in self._probing:
            return
        seen = self._sizes_run.setdefault(sched.gm, set())
        sizes = signature(batch)
        if sizes not in seen:
            seen.add(sizes)
            self._probing[sched.gm] = Probe(self._allocs.__contains__, eager_all=False)

    def _lower(self, key: ScheduleKey) -> None:
        """Make the executor of ``key``'s schedule now (its regions compiled), not inside the next step."""
        if key in self._schedules:
            self._executor_for(key, self._schedules[key])

    def _run_node_by_node(self, cap: CaptureKey, why: str) -> None:
        """From now on ``cap`` runs node by node (the measured curve holds there), which is several
        times slower than compiled regions: said at WARNING on the ``pscompile`` logger."""
        if cap not in self._node_by_node:
            log.warning("pscompile: %s runs node by node from now on, several times slower than compiled regions: "
                        "%s (a larger device_memory lets it run compiled)", cap.token[:80], why)
        self._node_by_node.add(cap)
