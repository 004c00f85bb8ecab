"""The compiler pipeline: the passes of ``passes/`` in order, as functions of data.

Three stages, each a frozen record with the provenance of every pass (name, seconds, summary)::

    capture_and_analyze(model, batch, params=, dtype=, backward=)          -> AnalyzedGraph
        capture_joint      forward + loss (+ backward) as one FX graph on fake tensors
        annotate_params    which node reads which parameter; last uses; phases
        estimate_nonmodel  static non-model bytes per node (gradients die at their store)

    choose_activations(analyzed, layout, policy=, budget=, ...)           -> AnalyzedGraph
        recompute_activations / offload_activations  the saved activations of the fewest
                           segments that let the schedule fit the budget, recomputed in the
                           backward or sent to the host (then the two analyses again)

    build_schedule(analyzed, layout, PlanRequest(...), nonmodel=, memory=)  -> Scheduled
        SCHEDULE_PASSES    plan_residency, prefetch_fetches, overlap_grad_copies, plan_lookahead,
                           insert_memory_ops, verify_schedule: one signature, run from a list
                           (``graph/schedule_passes.py``)

**One entry point plans every schedule**: ``plan_at_budget(analyzed, layout, request)`` runs the
activation choice, places optimizer states (or takes the running engine's ``DeviceMemory``) and
builds the schedule. The compiled engine, ``min_device_memory`` (through ``config_least``), the
budget sweep, ``pscompile.plan`` and the benches call it. ``PlanRequest.for_config`` makes the
request compiled mode makes from a ``Config``.

The first stage and the records all stages share are in ``graph/analysis.py``, the minimum budget
and the activation choice in ``graph/minimum.py``, the scheduling passes in
``graph/schedule_passes.py``; this module picks the chunk layout and runs the stages in order
(``plan_inputs``, ``plan_at_budget``, ``schedule_model``, ``BudgetSweep``).

Nothing here touches a chunk store or a real tensor: the inputs are the captured graph (fake
tensors), the ``ChunkLayout``, the budget and what the device holds besides the planned chunks
(``DeviceMemory``), and a non-model curve (the static estimate, or the one measured in the warm-up
step). So the same code plans a model built on the meta device, and the compiled engine is one
caller of it among others. ``captured.gm`` is shared by every schedule of one capture and is only
read: each schedule's graph carries its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pscompile.config import Config
from pscompile.resolved import resolve
from pscompile.errors import BudgetError
from pscompile.graph.analysis import (
    AnalyzedGraph,
    DeviceMemory,
    Scheduled,
    capture_and_analyze,
    gather_bytes,
    regather,
)
from pscompile.graph.minimum import (
    choose_activations,
    config_least,
    program_headroom,
)
from pscompile.kinds import Activations, RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.model_bytes import (GRAD_BYTES, STATE_BYTES, ModelBytes, dequant_workspace, device_homable,
                                          fetch_bytes, state_chunks)
from pscompile.memory.rates import Rates, measure_rates
from pscompile.memory.tiers import Tier
from pscompile.optim.placement import device_state_chunks, first_state_chunks
from pscompile.graph.schedule_passes import (
    SCHEDULE_PASSES,
    PlanRequest,
    SchedulePass,
    build_schedule,
)
from pscompile.runtime.batching import call_model
from pscompile.runtime.params import ModelParams, choose_layout, collect_params

__all__ = ["SCHEDULE_PASSES", "AnalyzedGraph", "BudgetSweep", "DeviceMemory", "LayoutChoice", "PlanRequest",
           "SchedulePass", "Scheduled", "build_schedule", "capture_and_analyze", "choose_activations",
           "config_least", "engine_layout", "layout_candidates", "pick_layout", "plan_at_budget", "plan_inputs",
           "plan_within",
           "schedule_model"]


@dataclass(frozen=True)
class LayoutChoice:
    """One candidate layout of ``pick_layout`` and what planning it at the budget gave."""

    chunk_size: int
    spans: int            # tensors spanning chunks
    utilisation: float
    least: int            # its least budget
    moved: int | None     # bytes its plan moves per step at the budget (None: it does not fit)


def pick_layout(analyzed: AnalyzedGraph, layouts: Sequence[ChunkLayout], config: Config, *, budget: int,
                world: int = 1, rank: int = 0, variants: dict[tuple, AnalyzedGraph] | None = None,
                leasts: dict[int, int] | None = None
                ) -> tuple[ChunkLayout, tuple[LayoutChoice, ...], Scheduled | None]:
    """Compiled mode's ``chunk_size="auto"``: of ``layouts`` (``layout_candidates``), the one whose
    plan at ``budget`` moves the fewest bytes per step (static curve, activations recomputed where
    they must leave: no measured rate, so every rank of a ZeRO run picks the same), where a larger
    chunk within ``MOVED_TOLERANCE`` of the fewest wins (fewer, larger transfers); if none fits, the
    one with the smallest least budget (so the error names it). Returns it, what was weighed, and its
    plan (``plan_only``: no graph; None if it does not fit). ``variants`` (activation rewrites) and ``leasts`` (chunk
    size -> least budget) are caches a caller planning many budgets may share."""
    variants = {} if variants is None else variants
    leasts = {} if leasts is None else leasts
    rows, plans = [], []
    for layout in layouts:
        a = regather(analyzed, gather_bytes(layout, config.dtype))
        if layout.chunk_size not in leasts:
            leasts[layout.chunk_size] = config_least(a, layout, config, world=world, rank=rank, variants=variants)
        least = leasts[layout.chunk_size]
        sched = None
        if least <= budget:
            try:
                sched = plan_at_budget(a, layout, PlanRequest.for_config(
                    config, budget=budget, world=world, rank=rank, plan_only=True), variants=variants)
            except BudgetError:
                sched = None
        plans.append(sched)
        moved = None if sched is None else sched.plan.h2d_bytes + sched.plan.d2h_bytes + 2 * sched.offload_bytes
        rows.append(LayoutChoice(layout.chunk_size, sum(e.spans for e in layout.entries), layout.utilisation,
                                 least, moved))
    fits = [i for i, r in enumerate(rows) if r.moved is not None]
    if fits:
        least_moved = min(rows[i].moved for i in fits)
        near = [i for i in fits if rows[i].moved <= least_moved * (1 + MOVED_TOLERANCE)]
        best = max(near, key=lambda i: (rows[i].chunk_size, rows[i].utilisation))
    else:
        best = min(range(len(rows)), key=lambda i: rows[i].least)
    return layouts[best], tuple(rows), plans[best]


# "auto" in compiled mode: the paged least-waste layouts with chunks of at most these fractions of
# the budget, and the one keeping every tensor whole (``engine_layout``)
PAGED_FRACTIONS = (8, 16, 32)
MOVED_TOLERANCE = 0.01     # a larger chunk that moves at most 1% more bytes is preferred


def layout_candidates(mp: ModelParams, config: Config, budget: int | None, *, world: int = 1,
                      per_chunk: bool = False) -> list[ChunkLayout]:
    """The layouts compiled mode weighs at ``budget`` (distinct chunk sizes, largest first): with an
    explicit ``chunk_size`` or no budget just ``choose_layout``'s; with "auto" the paged least-waste
    layouts with chunks of at most 1/8, 1/16 and 1/32 of the budget, and the whole-tensor one."""
    unit = 1 if per_chunk else world
    first = choose_layout(mp, config, budget, world=unit)
    if config.chunk_size != "auto" or budget is None:
        return [first]
    out = {first.chunk_size: first}
    for layout in [choose_layout(mp, config, budget, world=unit, fraction=f) for f in PAGED_FRACTIONS[1:]] + \
            [choose_layout(mp, config, budget, world=unit, pages=False)]:
        out.setdefault(layout.chunk_size, layout)
    return [out[k] for k in sorted(out, reverse=True)]


def engine_layout(mp: ModelParams, config: Config, budget: int | None, *, analyze: Callable[[], AnalyzedGraph],
                  world: int = 1, per_chunk: bool = False, variants: dict[tuple, AnalyzedGraph] | None = None,
                  leasts: dict[int, int] | None = None, kept=None) -> tuple[ChunkLayout, tuple[LayoutChoice, ...]]:
    """The layout the compiled engine uses at ``budget`` (less Inductor's headroom,
    ``minimum.program_headroom``, where a candidate fits there, else the whole budget): the only
    candidate of ``layout_candidates``, or the one ``pick_layout`` prefers after planning each on
    ``analyze()`` (the training capture, called only then). ``variants``: the activation rewrites
    of that capture, kept for the caller's own ``choose_activations`` on it; ``leasts``: the least
    budget per chunk size (``BudgetSweep`` shares both across budgets); ``kept``: choices kept across
    processes (``compiled.choice_store.ChoiceStore``), consulted before weighing and told after."""
    headroom = program_headroom(budget, config)
    for weighed in ((budget - headroom, budget) if headroom else (budget,)):
        layouts = layout_candidates(mp, config, weighed, world=world, per_chunk=per_chunk)
        if len(layouts) == 1:
            return layouts[0], ()
        analyzed = analyze()
        key = found = None
        if kept is not None:
            key = kept.key(analyzed.captured.gm, layouts, (weighed, world, per_chunk, config))
            found = kept.recall(key, layouts)
        if found is not None:
            layout, rows = found
        else:
            # every rank weighs rank 0's plans (per-chunk collectives move different bytes on each rank),
            # so all ranks of a ZeRO run pick one layout
            layout, rows, _ = pick_layout(analyzed, layouts, config, budget=weighed, world=world, rank=0,
                                          variants=variants, leasts=leasts)
            if kept is not None:
                kept.keep(key, layout, rows)
        if any(r.moved is not None for r in rows):
            break
    return layout, rows


def plan_within(plan: Callable[[int | None], Scheduled], budget: int | None, headroom: int) -> Scheduled:
    """``plan(b)`` at ``b = budget - headroom`` (``minimum.program_headroom``: room kept for
    Inductor's buffers), else at the least budget it needs where that lies between (the rest is
    headroom), else at ``budget``."""
    if headroom:
        try:
            return plan(budget - headroom)
        except BudgetError as e:
            if e.minimum and budget - headroom < e.minimum < budget:
                try:
                    return plan(e.minimum)
                except BudgetError:
                    pass
    return plan(budget)


def plan_inputs(model: nn.Module, batch: Any, config: Config, *, kind: RunKind = RunKind.TRAIN,
                loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                world: int = 1, per_chunk: bool = False) -> tuple[ChunkLayout, AnalyzedGraph]:
    """The layout and the analyzed capture of ``model`` on ``batch`` under ``config``, as the
    compiled engine makes them, without an engine (fake tensors: ``model`` may be on meta).
    ``world``: the ranks a ZeRO engine would shard over (no process group is needed to plan);
    ``per_chunk``: its collectives go per chunk, so the layout's unit stays one chunk."""
    kind, config = RunKind(kind), resolve(config)
    mp = collect_params(model, call_model, batch)
    analyzed = capture_and_analyze(model, batch, params=mp.params, dtype=config.dtype, backward=kind.backward,
                                   loss_fn=loss_fn)
    train = analyzed if kind.backward and kind is RunKind.TRAIN else None

    def analyze() -> AnalyzedGraph:
        return train if train is not None else capture_and_analyze(model, batch, params=mp.params,
                                                                   dtype=config.dtype, loss_fn=loss_fn)
    layout, _ = engine_layout(mp, config, config.device_memory, analyze=analyze, world=world, per_chunk=per_chunk)
    return layout, regather(analyzed, gather_bytes(layout, config.dtype))


class BudgetSweep:
    """What the compiled engine plans for one model and batch at any budget, from one capture: the
    layout it would choose there (``engine_layout``) and the schedule (``plan_at_budget``, which
    verifies it). For sweeps over budgets in tests and benchmarks; the activation rewrites and each
    layout's least budget are computed once for all budgets."""

    def __init__(self, model: nn.Module, batch: Any, config: Config, *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None):
        self.config = config = resolve(config)
        self.mp = collect_params(model, call_model, batch)
        self.analyzed = capture_and_analyze(model, batch, params=self.mp.params, dtype=config.dtype, loss_fn=loss_fn)
        self._variants: dict[tuple, AnalyzedGraph] = {}
        self._leasts: dict[int, int] = {}

    def layout(self, budget: int | None) -> ChunkLayout:
        return self._choose(budget)

    def plan(self, budget: int | None, *, rates: Rates | None = None, kind: RunKind = RunKind.TRAIN,
             measured: bool = False) -> Scheduled:
        """``measured``: plan as after the measuring step (its curve taken as measured), which
        adds the passes that only measured schedules run (``overlap_grad_copies``)."""
        layout = self._choose(budget)
        analyzed = regather(self.analyzed, gather_bytes(layout, self.config.dtype))

        def at(b: int | None) -> Scheduled:
            request = PlanRequest.for_config(self.config, budget=b, kind=kind, measured=measured)
            return plan_at_budget(analyzed, layout, request, rates=rates, variants=self._variants)
        return plan_within(at, budget, program_headroom(budget, self.config))

    def _choose(self, budget: int | None) -> ChunkLayout:
        return engine_layout(self.mp, self.config, budget, analyze=lambda: self.analyzed,
                             variants=self._variants, leasts=self._leasts)[0]


def schedule_model(model: nn.Module, batch: Any, config: Config, *, kind: RunKind = RunKind.TRAIN,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   world: int = 1, rank: int = 0, per_chunk: bool = False) -> tuple[ChunkLayout, Scheduled]:
    """The layout and the schedule compiled mode would start with for ``model`` on ``batch`` under
    ``config`` (static non-model estimate, optimizer states placed by the same rule), without an
    engine: no chunk store is made and no parameter is materialized, so ``model`` may live on the
    meta device. The budget is ``config.device_memory`` as given; ``world``/``rank`` plan one rank of
    a ZeRO run."""
    kind, config = RunKind(kind), resolve(config)
    layout, analyzed = plan_inputs(model, batch, config, kind=kind, loss_fn=loss_fn, world=world, per_chunk=per_chunk)
    rates = measure_rates(config.torch_device, config.dtype, config.link_bandwidth) \
        if config.activations == Activations.AUTO and config.device_memory is not None else None

    def at(budget: int | None) -> Scheduled:
        request = PlanRequest.for_config(config, budget=budget, kind=kind, world=world, rank=rank,
                                         per_chunk=per_chunk)
        return plan_at_budget(analyzed, layout, request, rates=rates)
    budget = config.device_memory
    return layout, plan_within(at, budget, program_headroom(budget, config))


def plan_at_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, request: PlanRequest, *,
                   nonmodel: Sequence[int] | None = None, memory: DeviceMemory | None = None,
                   variants: dict[tuple, AnalyzedGraph] | None = None, rates: Rates | None = None) -> Scheduled:
    """The one planning entry point: the verified schedule of ``analyzed`` for ``request``, with
    its provenance. Every schedule is planned here: the engine's, the minimum's, the budget
    sweep's, the planner's and the benches'.

    ``request.activations``' choice for the budget first (``variants`` and ``rates`` as in
    ``choose_activations``); then the device: ``memory`` as a running engine holds it (its
    optimizer states placed already), or, None, with optimizer states placed by
    ``optim.placement`` for the curve's peak (on the host with ZeRO); then ``build_schedule``'s
    passes. ``nonmodel``: the curve to plan with (default: the analyzed graph's static estimate;
    a measured one comes with ``request.measured``)."""
    if request.activations is not None:
        slot = ModelBytes.of(request.dtype).param_chunk(layout.chunk_size)
        # (ZeRO: the activations get the budget less the shards homed on the device)
        fixed = (memory.os_device_bytes if memory is not None else _zero_homes(layout, request)[1]) \
            if request.world > 1 else 0
        budget = None if request.budget is None else request.budget - fixed
        analyzed = choose_activations(analyzed, layout, policy=request.activations, budget=budget,
                                      slot_bytes=slot, world=request.world, variants=variants, rates=rates,
                                      host_room=request.host_room)
    nonmodel = analyzed.nonmodel if nonmodel is None else tuple(nonmodel)
    if memory is None:
        memory = _placed_memory(layout, request, peak_nonmodel=max(nonmodel))
    return build_schedule(analyzed, layout, request, nonmodel=nonmodel, memory=memory)


def _zero_homes(layout: ChunkLayout, request: PlanRequest) -> tuple[frozenset[int], int]:
    """ZeRO: the groups (per chunk: owned chunks) whose shard ``request.device_homes`` puts on
    the device, and their bytes there (fp32 master, Adam states, gradient buffer)."""
    owned = [c for c in range(layout.num_chunks) if not request.per_chunk or c % request.world == request.rank]
    homes = frozenset(device_homable(layout, owned)[:request.device_homes])
    unit = layout.chunk_size if request.per_chunk else layout.chunk_size // request.world
    return homes, len(homes) * unit * (STATE_BYTES + GRAD_BYTES)


def _param_disk(layout: ChunkLayout, count: int) -> frozenset[int]:
    """The last ``count`` chunks whose kind may be homed on disk, the engine's rule (``runtime.tiers``)."""
    movable = [c for c in range(layout.num_chunks) if layout.homed_on(c, Tier.DISK)]
    return frozenset(movable[len(movable) - count:]) if count else frozenset()


def _placed_memory(layout: ChunkLayout, request: PlanRequest, *, peak_nonmodel: int) -> DeviceMemory:
    """The device with optimizer states placed by ``optim.placement`` for ``peak_nonmodel`` (on the
    host with ZeRO)."""
    mb = ModelBytes.of(request.dtype)
    slot_bytes, state_bytes = mb.param_chunk(layout.chunk_size), mb.state_chunk(layout.chunk_size)
    if request.world > 1:         # ZeRO: the shards the host cannot hold are homed on the device
        homes, nbytes = _zero_homes(layout, request)
        return DeviceMemory(request.budget, slot_bytes, frozenset(), nbytes + dequant_workspace(layout),
                            world=request.world, rank=request.rank, per_chunk=request.per_chunk, device_shards=homes,
                            fetch_bytes=fetch_bytes(layout, slot_bytes))
    count = device_state_chunks(budget=request.budget, peak_nonmodel=peak_nonmodel, num_chunks=len(state_chunks(layout)),
                                param_chunks=layout.num_chunks, chunk_size=layout.chunk_size, param_chunk_bytes=slot_bytes,
                                state_chunk_bytes=state_bytes) if request.device_states else 0
    count = max(count, request.device_homes)
    on_device = first_state_chunks(layout, count)
    return DeviceMemory(request.budget, slot_bytes, on_device,
                        STATE_BYTES * sum(map(layout.state_extent, on_device)) + dequant_workspace(layout),
                        world=request.world, rank=request.rank, per_chunk=request.per_chunk,
                        param_disk=_param_disk(layout, request.param_disk_chunks),
                        fetch_bytes=fetch_bytes(layout, slot_bytes))
