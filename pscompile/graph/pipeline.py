"""The compiler pipeline: the passes of ``passes/`` in order, as functions of data.

Two stages, each a frozen record with the provenance of every pass (name, seconds, summary)::

    capture_and_analyze(model, batch, params=, dtype=, backward=)          -> AnalyzedGraph
        capture_joint      forward + loss (+ backward) as one FX graph on fake tensors
        annotate_params    which node reads which parameter; last uses; phases
        estimate_nonmodel  static non-model bytes per node (gradients die at their store)

    choose_activations(analyzed, layout, policy=, budget=, ...)           -> AnalyzedGraph
        recompute_activations  the saved activations of the fewest segments that let the
                               schedule fit the budget, recomputed in the backward (then the
                               two analyses again, on the rewritten graph)

    build_schedule(analyzed, layout, nonmodel=, memory=DeviceMemory(...), kind=)  -> Scheduled
        plan_residency     Belady residency of every chunk at every node, static slots
        prefetch_fetches   fetches start as early as capacity allows, a wait where they were
        overlap_grad_copies  (a measured micro-batch of accumulation) each gradient's copy to the
                           host runs while later nodes compute; the gradient held until its wait
        insert_memory_ops  the scheduled graph: memory nodes, parameters read as slot views
        verify_schedule    the invariants, replayed symbolically

The first stage and the records all stages share are in ``graph/analysis.py``, the minimum budget
and the activation choice in ``graph/minimum.py``; this module schedules, picks the chunk layout
and runs the stages in order (``plan_inputs``, ``plan_at_budget``, ``schedule_model``,
``BudgetSweep``), and re-exports the names of the other two.

Nothing here touches a chunk store or a real tensor: the inputs are the captured graph (fake
tensors), the ``ChunkLayout``, the budget and what the device holds besides the planned chunks
(``DeviceMemory``), and a non-model curve (the static estimate, or the one measured in the warm-up
step). So the same code plans a model built on the meta device, and the compiled engine is one
caller of it among others. ``captured.gm`` is shared by every schedule of one capture and is only
read: each schedule's graph carries its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from pscompile.config import Config
from pscompile.errors import BudgetError, ResidencyError
from pscompile.graph.analysis import (
    AnalyzedGraph,
    DeviceMemory,
    PassTiming,
    Scheduled,
    _Passes,
    capture_and_analyze,
    describe_node,
    executed_nodes,
    gather_bytes,
    grad_store_points,
    grad_stores,
    node_reads,
    node_windows,
    regather,
    with_gathers,
)
from pscompile.graph.meta import storage_bytes
from pscompile.graph.minimum import (
    Minimum,
    choose_activations,
    config_least,
    least_budget,
    minimum_budget,
)
from pscompile.graph.ops import activation_move, is_offload
from pscompile.kinds import Activations, Collectives, RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.memory.model_bytes import ModelBytes
from pscompile.memory.rates import Rates, measure_rates
from pscompile.optim.placement import device_state_chunks
from pscompile.passes.insert_memory_ops import insert_memory_ops
from pscompile.passes.overlap_grad_copies import overlap_grad_copies
from pscompile.passes.plan_lookahead import plan_lookahead
from pscompile.passes.plan_residency import GradStore, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from pscompile.passes.verify_schedule import verify_schedule
from pscompile.runtime.batching import call_model
from pscompile.runtime.params import ModelParams, choose_layout, collect_params
from pscompile.units import format_bytes

__all__ = ["AnalyzedGraph", "BudgetSweep", "DeviceMemory", "LayoutChoice", "Minimum", "PassTiming", "Scheduled",
           "build_schedule", "capture_and_analyze", "choose_activations", "config_least", "engine_layout",
           "executed_nodes", "gather_bytes", "grad_store_points", "grad_stores", "layout_candidates",
           "least_budget", "minimum_budget", "node_reads", "node_windows", "pick_layout", "plan_at_budget",
           "plan_inputs", "regather", "schedule_model", "with_gathers"]


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
                sched = plan_at_budget(a, layout, budget=budget, dtype=config.dtype, world=world, rank=rank,
                                       per_chunk=config.collectives == Collectives.PER_CHUNK and world > 1,
                                       activations=config.activations, variants=variants, plan_only=True,
                                       planner=config.planner)
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


def build_schedule(analyzed: AnalyzedGraph, layout: ChunkLayout, *, nonmodel: Sequence[int],
                   memory: DeviceMemory, dtype: torch.dtype, kind: RunKind = RunKind.TRAIN,
                   measured: bool = False, start: Mapping[int, int] | None = None,
                   plan_only: bool = False, lookahead: bool = False, planner: str = "belady") -> Scheduled:
    """Plan, rewrite and verify one schedule of ``analyzed`` under ``memory`` (``plan_only``: stop
    after planning, with ``gm=None``; for weighing plans by their traffic, ``pick_layout``).

    Accumulation and evaluation runs update nothing, so they keep clean chunks resident at the
    end for the next run; ``start`` (chunk -> slot) plans the warm variant, which starts from that
    residency and ends with it again.

    ``lookahead`` (a training step whose chunks the host updates, one rank): ``plan_lookahead``
    picks the chunks the step fetches for the next one after their update. With ``start`` the plan
    is that next step's: it starts with ``start``'s chunks in flight, ends like a cold step, and
    fetches the same chunks ahead again. ``planner``: ``plan_residency``'s victim policy
    (``Config.planner``). Raises ``BudgetError`` naming the node and the budget it
    needs when ``memory.budget`` is too small.

    Long on purpose: the passes of the second stage in order, each stamped with its provenance.
    """
    kind = RunKind(kind)
    captured = analyzed.captured
    nodes = list(captured.gm.graph.nodes)
    nonmodel = tuple(nonmodel)
    elsize = torch.empty((), dtype=dtype).element_size()
    stores: dict[int, list[GradStore]] = {}
    for fqn, at in analyzed.grad_store_points.items():
        stores.setdefault(at, []).extend(grad_stores(layout.entry(fqn), elsize))
    budget, os_dev, os_bytes = memory.budget, memory.os_device_chunks, memory.os_device_bytes
    windows = node_windows(captured, nonmodel)
    warm = kind.keeps_warm
    ahead = lookahead and kind is RunKind.TRAIN and start is not None    # started from a lookahead
    passes = _Passes(analyzed.passes)
    try:
        world = memory.world
        reads = node_reads(captured, layout, hold_grads=analyzed.grad_store_points if world > 1 else None)
        plan = passes.run("plan_residency", lambda: plan_residency(
            reads, nonmodel, stores=stores, num_chunks=layout.num_chunks,
            slot_bytes=memory.slot_bytes, budget=budget, os_device_chunks=os_dev, os_device_bytes=os_bytes,
            accumulate=kind is RunKind.ACCUM, start=start, keep_at_end=warm, end=start if warm else None,
            start_in_flight=ahead,
            describe_node=lambda i: describe_node(nodes[i]), windows=windows, world=world, rank=memory.rank,
            per_chunk=memory.per_chunk, policy=planner),
            lambda p: p.summary(budget))
    except ResidencyError as e:
        least = minimum_budget(analyzed, layout, nonmodel=nonmodel, slot_bytes=memory.slot_bytes, world=memory.world)
        if budget >= least.nbytes:        # room for every node's chunks, not next to these optimizer states
            raise BudgetError(f"{e} (device_memory={format_bytes(budget)})") from e
        raise BudgetError(f"device_memory={format_bytes(budget)} ({budget} bytes) is below the minimum "
                          f"{format_bytes(least.nbytes)} ({least.nbytes} bytes) this model needs: "
                          f"{least.describe(nodes)}; give device_memory >= {least.nbytes} (with chunk_size="
                          f"{layout.chunk_size}), a smaller batch or mode='hooks'", minimum=least.nbytes) from e
    plan, _ = passes.run("prefetch_fetches", lambda: prefetch_fetches(plan, nonmodel, budget=budget,
                                                                        os_device_bytes=os_bytes, windows=windows),
                         lambda r: r[1].summary)
    if kind is RunKind.ACCUM and measured:   # (the measuring run keeps each gradient's death where the graph has it)
        out = next(n for n in reversed(nodes) if n.op == "output")
        held = {f: storage_bytes(g) for f, g in zip(captured.grad_fqns, out.args[0][1:])
                if isinstance(g, fx.Node) and storage_bytes(g) is not None}
        plan, _ = passes.run("overlap_grad_copies", lambda: overlap_grad_copies(
            plan, windows, budget=budget, os_device_bytes=os_bytes, grad_bytes=held), lambda r: r[1].summary)
    fetched_ahead = None
    if lookahead and kind is RunKind.TRAIN:
        fetched_ahead = passes.run("plan_lookahead", lambda: plan_lookahead(
            plan, windows, budget=budget, os_device_bytes=os_bytes, os_device_chunks=os_dev,
            fixed=tuple((c, k) for c, k in (start or {}).items() if c not in os_dev) if ahead else None),
            lambda la: la.summary())
        # the step's bytes include the fetches it issues for the next step (after its update)
        plan = replace(plan, h2d_bytes=plan.h2d_bytes + fetched_ahead.nbytes,
                       num_fetches=plan.num_fetches + len(fetched_ahead.fetches))
    if plan_only:
        return Scheduled(captured, plan, None, nonmodel, measured, tuple(passes.timings), kind, os_dev,
                         analyzed.activations, analyzed.activations.offload_bytes if analyzed.activations else 0,
                         fetched_ahead)
    gm = passes.run("insert_memory_ops", lambda: insert_memory_ops(
        captured.gm, plan, layout, param_fqns=captured.param_fqns, grad_fqns=captured.grad_fqns,
        compute_dtype=dtype, nonmodel=nonmodel, world=memory.world, rank=memory.rank,
        per_chunk=memory.per_chunk), lambda g: "")
    report = passes.run("verify_schedule", lambda: verify_schedule(
        gm, layout, slot_bytes=memory.slot_bytes, budget=budget, initial=dict(plan.initial),
        os_device_chunks=os_dev, os_device_bytes=os_bytes, final=dict(plan.final) if warm else None,
        world=memory.world, grad_fqns=captured.grad_fqns if kind.backward else (), per_chunk=memory.per_chunk,
        arriving=frozenset(k for c, k in (start or {}).items() if c not in os_dev) if ahead else frozenset()),
        lambda r: r.summary(budget))
    timings = list(passes.timings)        # insert_memory_ops reports what verify_schedule counted
    i = next(k for k, t in enumerate(timings) if t.name == "insert_memory_ops")
    timings[i] = PassTiming("insert_memory_ops", timings[i].seconds,
                            f"insert_memory_ops: {report.num_memory_nodes} memory nodes")
    offloaded = sum(activation_move(n).nbytes for n in gm.graph.nodes if is_offload(n))
    return Scheduled(captured, plan, gm, nonmodel, measured, tuple(timings), kind, os_dev, analyzed.activations,
                     offloaded, fetched_ahead)


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
                  world: int = 1, per_chunk: bool = False) -> tuple[ChunkLayout, tuple[LayoutChoice, ...]]:
    """The layout the compiled engine uses at ``budget``: the only candidate of
    ``layout_candidates``, or the one ``pick_layout`` prefers after planning each on ``analyze()``
    (the training capture, called only then)."""
    layouts = layout_candidates(mp, config, budget, world=world, per_chunk=per_chunk)
    if len(layouts) == 1:
        return layouts[0], ()
    # every rank weighs rank 0's plans (per-chunk collectives move different bytes on each rank),
    # so all ranks of a ZeRO run pick one layout
    return pick_layout(analyze(), layouts, config, budget=budget, world=world, rank=0)[:2]


def plan_inputs(model: nn.Module, batch: Any, config: Config, *, kind: RunKind = RunKind.TRAIN,
                loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                world: int = 1, per_chunk: bool = False) -> tuple[ChunkLayout, AnalyzedGraph]:
    """The layout and the analyzed capture of ``model`` on ``batch`` under ``config``, as the
    compiled engine makes them, without an engine (fake tensors: ``model`` may be on meta).
    ``world``: the ranks a ZeRO engine would shard over (no process group is needed to plan);
    ``per_chunk``: its collectives go per chunk, so the layout's unit stays one chunk."""
    kind = RunKind(kind)
    mp = collect_params(model, batch, call_model)
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
        self.config = config
        self.mp = collect_params(model, batch, call_model)
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
        return plan_at_budget(analyzed, layout, budget=budget, dtype=self.config.dtype, kind=kind,
                              activations=self.config.activations, rates=rates, variants=self._variants,
                              planner=self.config.planner, measured=measured or None)

    def _choose(self, budget: int | None) -> ChunkLayout:
        layouts = layout_candidates(self.mp, self.config, budget)
        if len(layouts) == 1:
            return layouts[0]
        return pick_layout(self.analyzed, layouts, self.config, budget=budget, variants=self._variants,
                           leasts=self._leasts)[0]


def schedule_model(model: nn.Module, batch: Any, config: Config, *, kind: RunKind = RunKind.TRAIN,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   world: int = 1, rank: int = 0, per_chunk: bool = False) -> tuple[ChunkLayout, Scheduled]:
    """The layout and the schedule compiled mode would start with for ``model`` on ``batch`` under
    ``config`` (static non-model estimate, optimizer states placed by the same rule), without an
    engine: no chunk store is made and no parameter is materialized, so ``model`` may live on the
    meta device. The budget is ``config.device_memory`` as given; ``world``/``rank`` plan one rank of
    a ZeRO run."""
    kind = RunKind(kind)
    layout, analyzed = plan_inputs(model, batch, config, kind=kind, loss_fn=loss_fn, world=world, per_chunk=per_chunk)
    rates = measure_rates(config.torch_device, config.dtype, config.link_bandwidth) \
        if config.activations == Activations.AUTO and config.device_memory is not None else None
    return layout, plan_at_budget(analyzed, layout, budget=config.device_memory, dtype=config.dtype, kind=kind,
                                  world=world, rank=rank, per_chunk=per_chunk, activations=config.activations,
                                  rates=rates, planner=config.planner)


def plan_at_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, *, budget: int | None, dtype: torch.dtype,
                   kind: RunKind = RunKind.TRAIN, nonmodel: Sequence[int] | None = None,
                   world: int = 1, rank: int = 0, per_chunk: bool = False, activations: str | None = None,
                   variants: dict[tuple, AnalyzedGraph] | None = None, rates: Rates | None = None,
                   host_room: int | None = None, plan_only: bool = False, planner: str = "belady",
                   measured: bool | None = None, lookahead: bool = False,
                   start: Mapping[int, int] | None = None, memory: DeviceMemory | None = None) -> Scheduled:
    """The schedule the compiled engine plans for ``analyzed`` at ``budget``: the activation
    policy's choice for the budget (``activations``: a ``Config.activations`` value; None plans
    ``analyzed`` as it is; ``variants`` as in ``choose_activations``), optimizer states placed by
    ``optim.placement`` for the curve's peak (on the host with ZeRO), then ``build_schedule``.
    ``measured`` (default: whether ``nonmodel`` was given) plans as after the measuring step;
    ``lookahead`` and ``start`` as in ``build_schedule`` (a training step of one rank that fetches
    the next step's first chunks after their update, and the step that starts with them).
    ``memory``: the device as a running engine holds it (its optimizer states placed already);
    None places them by the rule. Every schedule is planned here: the engine's, the minimum's,
    the budget sweep's and the planner's."""
    if activations is not None:
        slot = ModelBytes.of(dtype).param_chunk(layout.chunk_size)
        analyzed = choose_activations(analyzed, layout, policy=activations, budget=budget, slot_bytes=slot,
                                      world=world, variants=variants, rates=rates, host_room=host_room)
    nonmodel = analyzed.nonmodel if nonmodel is None else tuple(nonmodel)
    if memory is None:
        memory = _placed_memory(layout, budget=budget, dtype=dtype, peak_nonmodel=max(nonmodel), world=world,
                                rank=rank, per_chunk=per_chunk)
    measured = nonmodel is not analyzed.nonmodel if measured is None else measured
    return build_schedule(analyzed, layout, nonmodel=nonmodel, memory=memory, dtype=dtype, kind=kind,
                          measured=measured, plan_only=plan_only, planner=planner, lookahead=lookahead,
                          start=start)


def _placed_memory(layout: ChunkLayout, *, budget: int | None, dtype: torch.dtype, peak_nonmodel: int,
                   world: int, rank: int, per_chunk: bool) -> DeviceMemory:
    """The device with optimizer states placed by ``optim.placement`` for ``peak_nonmodel`` (on the
    host with ZeRO)."""
    mb = ModelBytes.of(dtype)
    slot_bytes, state_bytes = mb.param_chunk(layout.chunk_size), mb.state_chunk(layout.chunk_size)
    count = device_state_chunks(budget=budget, peak_nonmodel=peak_nonmodel, num_chunks=layout.num_chunks,
                                chunk_size=layout.chunk_size, param_chunk_bytes=slot_bytes,
                                state_chunk_bytes=state_bytes) if world == 1 else 0
    return DeviceMemory(budget, slot_bytes, frozenset(range(count)), count * state_bytes, world=world, rank=rank,
                        per_chunk=per_chunk)
