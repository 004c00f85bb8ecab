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

Nothing here touches a chunk store or a real tensor: the inputs are the captured graph (fake
tensors), the ``ChunkLayout``, the budget and what the device holds besides the planned chunks
(``DeviceMemory``), and a non-model curve (the static estimate, or the one measured in the warm-up
step). So the same code plans a model built on the meta device, and the compiled engine is one
caller of it among others. ``captured.gm`` is shared by every schedule of one capture and is only
read: each schedule's graph carries its own metadata.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from pscompile.config import Config
from pscompile.errors import BudgetError, ResidencyError
from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.graph.meta import storage_bytes
from pscompile.graph.ops import activation_move, is_offload
from pscompile.kinds import Activations, Collectives, RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.optim.placement import device_state_chunks
from pscompile.passes.annotate_params import ParamUses, annotate_params
from pscompile.passes.estimate_nonmodel import estimate_nonmodel
from pscompile.passes.insert_memory_ops import insert_memory_ops
from pscompile.passes.plan_lookahead import Lookahead, plan_lookahead
from pscompile.passes.plan_residency import GradStore, ResidencyPlan, arrival_windows, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from pscompile.passes.overlap_grad_copies import overlap_grad_copies
from pscompile.memory.rates import Rates, measure_rates
from pscompile.passes.offload_activations import find_offloads, offload_activations
from pscompile.passes.recompute_activations import ActivationPlan, find_segments, recompute_activations
from pscompile.passes.verify_schedule import verify_schedule
from pscompile.runtime.batching import call_model
from pscompile.runtime.params import ModelParams, choose_layout, collect_params
from pscompile.units import format_bytes

__all__ = ["PassTiming", "AnalyzedGraph", "DeviceMemory", "Scheduled", "capture_and_analyze",
           "build_schedule", "choose_activations", "gather_bytes", "with_gathers", "grad_stores", "regather", "config_least", "pick_layout", "LayoutChoice", "engine_layout", "layout_candidates", "BudgetSweep", "plan_inputs", "least_budget", "plan_at_budget", "schedule_model", "minimum_budget", "Minimum", "grad_store_points", "node_reads",
           "node_windows", "executed_nodes"]


@dataclass(frozen=True)
class PassTiming:
    """Provenance of one pass: what ran, how long it took, its one-line summary."""

    name: str
    seconds: float
    summary: str


@dataclass(frozen=True)
class AnalyzedGraph:
    """A captured graph with the analyses every schedule of it starts from."""

    captured: CapturedGraph
    uses: ParamUses
    nonmodel: tuple[int, ...]            # static estimate per node, gradients dying at their store
    grad_store_points: Mapping[str, int]  # fqn -> node after which its gradient takes the param's place
    passes: tuple[PassTiming, ...]
    activations: ActivationPlan | None = None   # what recompute_activations chose (None: not asked)
    gathers: Mapping[str, int] | None = None    # fqn -> bytes of its gathered copy (tensors spanning chunks)


@dataclass(frozen=True)
class DeviceMemory:
    """The device as the planner sees it: the budget, the slot size, and the optimizer-state
    chunks that live on the device (resident in slots 0..k-1 for the whole iteration)."""

    budget: int | None                     # device_memory in bytes; None = unlimited
    slot_bytes: int                        # one parameter chunk in the compute dtype
    os_device_chunks: frozenset[int] = frozenset()
    os_device_bytes: int = 0               # their fp32 master + exp_avg + exp_avg_sq bytes
    world: int = 1                         # ZeRO: ranks each chunk (a communication group) is sharded over
    rank: int = 0                          # ... and which of them plans (its shard is its host home)
    per_chunk: bool = False                # ZeRO collectives per chunk (broadcast/reduce), not per group


@dataclass(frozen=True)
class Scheduled:
    """One schedule: the plan, the rewritten graph, and how they were made."""

    captured: CapturedGraph
    plan: ResidencyPlan
    gm: fx.GraphModule | None          # None: planned only (``build_schedule(plan_only=True)``)
    nonmodel: tuple[int, ...]          # per node of the captured graph, the curve planned with
    measured: bool                     # that curve was measured (else: the static estimate)
    passes: tuple[PassTiming, ...]
    kind: RunKind = RunKind.TRAIN
    os_device: frozenset[int] = frozenset()   # chunks whose optimizer states were on the device
    activations: ActivationPlan | None = None  # the analyzed graph's recomputation and offloading
    offload_bytes: int = 0                     # saved activations the graph sends to the host (and back)
    lookahead: Lookahead | None = None         # training: chunks fetched for the next step after their update


class _Passes:
    """Runs passes in order and records their provenance."""

    def __init__(self, earlier: tuple[PassTiming, ...] = ()):
        self.timings = list(earlier)

    def run(self, name: str, fn: Callable[[], Any], summary: Callable[[Any], str]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.timings.append(PassTiming(name, time.perf_counter() - t0, summary(out)))
        return out


def grad_store_points(captured: CapturedGraph, uses: ParamUses) -> dict[str, int]:
    """The node after which each gradient overwrites its parameter's chunk space: once the
    gradient exists and the parameter's last (view-aware) read is done."""
    nodes = list(captured.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = {}
    for fqn, grad_node in zip(captured.grad_fqns, nodes[-1].args[0][1:]):
        last = uses[fqn].last_use
        out[fqn] = max(index[grad_node], last if last is not None else 0)
    return out


def capture_and_analyze(model: nn.Module, batch: Any, *, params: Mapping[str, nn.Parameter],
                        dtype: torch.dtype, backward: bool = True,
                        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                        gathers: Mapping[str, int] | None = None, sources: bool = False) -> AnalyzedGraph:
    """Capture the iteration of ``model`` on ``batch`` (fake tensors: the model may live on the
    meta device) and run the analyses every schedule of it shares. float16 graphs take the loss
    scale as their last input (``capture_joint(loss_scale=True)``). ``gathers`` (``gather_bytes``
    of the layout): each reader of a tensor that spans chunks holds a gathered copy of it, which
    the non-model curve counts. ``sources``: nodes keep their model source line (``capture_joint``)."""
    passes = _Passes()
    captured = passes.run("capture_joint" if backward else "capture_forward",
                          lambda: capture_joint(model, batch, params=dict(params), loss_fn=loss_fn,
                                                param_dtype=dtype, backward=backward,
                                                loss_scale=dtype == torch.float16, sources=sources),
                          lambda c: c.summary)
    return _analyze(captured, passes, gathers=gathers)


def _analyze(captured: CapturedGraph, passes: _Passes, activations: ActivationPlan | None = None,
             gathers: Mapping[str, int] | None = None) -> AnalyzedGraph:
    uses = passes.run("annotate_params", lambda: annotate_params(captured), lambda u: u.summary)
    stores = grad_store_points(captured, uses)
    curve = passes.run("estimate_nonmodel", lambda: estimate_nonmodel(captured, uses, grads_stored_at=stores),
                       lambda c: c.summary)
    nonmodel = with_gathers(curve.without_outputs, captured, gathers)
    return AnalyzedGraph(captured, uses, nonmodel, stores, tuple(passes.timings), activations,
                         dict(gathers) if gathers else None)


def regather(analyzed: AnalyzedGraph, gathers: Mapping[str, int] | None) -> AnalyzedGraph:
    """``analyzed`` for another layout: its curve with the gathered copies of ``gathers`` instead
    of its own (the capture and every other analysis do not depend on the layout)."""
    if dict(gathers or {}) == dict(analyzed.gathers or {}):
        return analyzed
    base = with_gathers(analyzed.nonmodel, analyzed.captured, {f: -b for f, b in (analyzed.gathers or {}).items()})
    return replace(analyzed, nonmodel=with_gathers(base, analyzed.captured, gathers),
                   gathers=dict(gathers) if gathers else None)


def gather_bytes(layout: ChunkLayout, dtype: torch.dtype) -> dict[str, int]:
    """fqn -> bytes of the gathered copy a reader of it holds, for every tensor that spans chunks
    (its pages sit in separate slots; ``insert_memory_ops`` concatenates them for each reader)."""
    elsize = torch.empty((), dtype=dtype).element_size()
    return {e.fqn: e.numel * elsize for e in layout.entries if e.spans}


def with_gathers(curve: Sequence[int], captured: CapturedGraph,
                 gathers: Mapping[str, int] | None) -> tuple[int, ...]:
    """``curve`` with each node's gathered copies added: a node that reads a tensor spanning chunks
    runs while the copy made right before it is live (once per tensor it reads)."""
    if not gathers:
        return tuple(curve)
    return tuple(b + sum(gathers.get(f, 0) for f in set(fqns)) for b, fqns in zip(curve, captured.param_reads))


def grad_stores(entry, elsize: int) -> list[GradStore]:
    """The stores of one parameter's gradient: one per page (one in all when it fits a chunk)."""
    if not entry.spans:
        p = entry.pieces[0]
        return [GradStore(p.chunk, entry.fqn, p.chunk_offset, entry.numel * elsize)]
    return [GradStore(p.chunk, entry.fqn, p.chunk_offset, p.numel * elsize, p.tensor_offset, p.numel)
            for p in entry.pieces]


def choose_activations(analyzed: AnalyzedGraph, layout: ChunkLayout, *, policy: str, budget: int | None,
                       slot_bytes: int, world: int = 1, device_homes: int = 0, state_bytes: int = 0,
                       variants: dict[tuple, AnalyzedGraph] | None = None, rates: Rates | None = None,
                       host_room: int | None = None) -> AnalyzedGraph:
    """The analyzed graph to plan with under ``policy`` (``Config.activations``).

    "keep": ``analyzed`` as it is. "recompute": every segment with saved activations recomputed.
    "offload": every segment's offloadable storages (``offload_activations.find_offloads``) on the
    host, the rest kept; ``ValueError`` if the host has no room for them (``host_room`` bytes besides
    the chunks; None: unlimited). "auto": none when the graph fits ``budget`` as it is
    (``minimum_budget`` on its static curve), else the fewest segments, largest saved bytes first,
    that let it fit (by bisection), each taken off the device the cheaper way by ``rates``:
    recomputed (its FLOPs at the device's rate) or offloaded (its bytes twice over the link, less
    what overlaps compute: ``Rates.offload_s``; only while the host has room; without ``rates``
    never). If all of them that way do not fit, the
    fewest recomputed, or else offloaded, that fit. Below the least budget of all recomputed and
    all offloaded it refuses (the graph it returns does not fit), even where a mix would fit: the
    least budget (``least_budget``) must not depend on the measured rates. ``variants`` (a dict, initially empty) lets a
    caller that plans one capture at many budgets rewrite each graph once."""
    if policy == Activations.KEEP or not analyzed.captured.backward:
        return analyzed
    segments = find_segments(analyzed.captured)
    offloads = find_offloads(analyzed.captured, segments)
    by_size = sorted(segments, key=lambda s: -s.saved_bytes)
    cache: dict[tuple, AnalyzedGraph] = {} if variants is None else variants

    def offload_bytes(s) -> int:
        return sum(o.nbytes for o in offloads.get(s.index, ()))

    total_offload = sum(map(offload_bytes, segments))
    host_fits_all = host_room is None or total_offload <= host_room
    if policy == Activations.OFFLOAD and not host_fits_all:
        raise ValueError(f"activations='offload': the saved activations need {format_bytes(total_offload)} of host "
                         f"memory besides the chunks and host_memory leaves {format_bytes(host_room)}; give more "
                         f"host_memory, or activations='auto' (recomputes what the host cannot take)")
    every = {Activations.RECOMPUTE: [Activations.RECOMPUTE] * len(by_size),
             Activations.OFFLOAD: [Activations.OFFLOAD if s.index in offloads else Activations.KEEP for s in by_size]}
    mixed, room = [], host_room           # auto: each segment the cheaper way, offloads while the host has room
    for s in by_size:
        cheaper = (rates is not None and s.index in offloads
                   and rates.offload_s(offload_bytes(s), s.flops) < rates.recompute_s(s.flops)
                   and (room is None or offload_bytes(s) <= room))
        mixed.append(Activations.OFFLOAD if cheaper else Activations.RECOMPUTE)
        if cheaper and room is not None:
            room -= offload_bytes(s)

    def variant(m: int, how_each: Sequence[str], overlap: bool = False) -> AnalyzedGraph:
        chosen = by_size[:m]
        rec = [s for s, how in zip(chosen, how_each) if how == Activations.RECOMPUTE]
        off = [s for s, how in zip(chosen, how_each) if how == Activations.OFFLOAD]
        overlap = overlap and bool(off)
        key = (tuple(s.index for s in rec), tuple(s.index for s in off), overlap)
        if key not in cache:
            plan = ActivationPlan(policy, segments, tuple(sorted(s.index for s in rec)),
                                  tuple(sorted(s.index for s in off)), sum(map(offload_bytes, off)), overlap)
            if not rec and not off:
                cache[key] = replace(analyzed, activations=plan)
            else:
                passes = _Passes(analyzed.passes)
                captured = analyzed.captured
                if rec:
                    captured = passes.run("recompute_activations", lambda: recompute_activations(captured, rec),
                                          lambda c: f"recompute_activations: {len(rec)} of {len(segments)} segments, "
                                                    f"{format_bytes(sum(s.saved_bytes for s in rec))} of saved "
                                                    f"activations recomputed")
                if off:
                    moves = [o for s in off for o in offloads[s.index]]
                    captured = passes.run("offload_activations",
                                          lambda: offload_activations(captured, moves, overlap=overlap),
                                          lambda c: f"offload_activations: {len(off)} of {len(segments)} segments, "
                                                    f"{len(moves)} storages, {format_bytes(plan.offload_bytes)} of "
                                                    f"saved activations wait on the host"
                                                    + (", copies overlapped" if overlap else ""))
                cache[key] = _analyze(captured, passes, plan, analyzed.gathers)
        # one cache serves every layout: a rewrite is analyzed once, and carries this layout's gathers
        got = regather(cache[key], analyzed.gathers)
        return replace(got, activations=replace(got.activations, policy=policy))

    def least(a: AnalyzedGraph) -> int:
        return minimum_budget(a, layout, nonmodel=a.nonmodel, slot_bytes=slot_bytes, world=world,
                              device_homes=device_homes, state_bytes=state_bytes).nbytes

    def fits_graph(a: AnalyzedGraph) -> bool:
        return budget is None or least(a) <= budget

    def fits(m: int, how_each: Sequence[str] = mixed) -> bool:
        return fits_graph(variant(m, how_each))

    def with_first(m: int, how_each: Sequence[str]) -> AnalyzedGraph:
        """The choice: offloads overlapped with compute where that still fits (a reload issued one
        ahead holds its bytes longer), else waited for where they are."""
        overlapped = variant(m, how_each, overlap=True)
        return overlapped if fits_graph(overlapped) else variant(m, how_each)

    n = len(by_size)
    if policy in every:
        return with_first(n, every[policy])
    if n == 0 or fits(0):
        return with_first(0, mixed)
    fallbacks = [Activations.RECOMPUTE] + ([Activations.OFFLOAD] if host_fits_all and offloads else [])

    def least_of(way: str) -> int:
        return least(variant(n, every[way]))
    smallest = min(fallbacks, key=least_of)
    if budget < least_of(smallest):
        # below what all recomputed or all offloaded fits in, auto refuses (the least budget must not
        # depend on the measured rates), whatever a mix might fit in
        return with_first(n, every[smallest])
    # the fewest segments that fit, each the cheaper way; if even all of them that way do not fit,
    # the fewest recomputed, or else offloaded (one of the two fits all: the budget is above its least)
    how = next(h for h in (mixed, *(every[w] for w in fallbacks)) if fits(n, h))
    lo, hi = 1, n                      # the smallest m with fits(m)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid, how):
            hi = mid
        else:
            lo = mid + 1
    return with_first(lo if fits(lo, how) else n, how)


@dataclass(frozen=True)
class Minimum:
    """The smallest budget a capture's schedules fit in, and the node that sets it."""

    nbytes: int          # chunks read at ``node`` x slot bytes + its window of non-model bytes
    node: int            # index in the captured graph
    chunks: int          # chunks ``node`` reads
    slot_bytes: int
    window: int          # non-model bytes its chunks must fit next to

    def describe(self, nodes: Sequence[fx.Node]) -> str:
        return (f"at {describe_node(nodes[self.node])}, {self.chunks} chunk(s) of {self.slot_bytes} bytes "
                f"read there + {self.window} bytes of non-model data")


def minimum_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, *, nonmodel: Sequence[int],
                   slot_bytes: int, world: int = 1, device_homes: int = 0, state_bytes: int = 0) -> Minimum:
    """The smallest ``device_memory`` every schedule of ``analyzed`` fits in with this layout and
    curve: at every node, the chunks it reads next to its window (``node_windows``), optimizer
    states on the host. plan_residency succeeds at any budget from here up (it may evict everything
    else), and so do the passes after it, which keep its per-node bounds. Sharded (``world > 1``),
    a group that holds some of its gradients counts as read until it holds all of them.
    ``device_homes``: the first chunks live on the device for the whole iteration (the host cannot
    hold them), each with ``state_bytes`` of optimizer states."""
    reads = node_reads(analyzed.captured, layout, hold_grads=analyzed.grad_store_points if world > 1 else None)
    windows = node_windows(analyzed.captured, nonmodel)
    best = Minimum(0, 0, 0, slot_bytes, 0)
    homes = set(range(device_homes))
    for i, (chunks, w) in enumerate(zip(reads, windows)):
        chunks = set(chunks) | homes
        need = len(chunks) * slot_bytes + w + device_homes * state_bytes
        if need > best.nbytes:
            best = Minimum(need, i, len(chunks), slot_bytes, w)
    return best


def least_budget(analyzed: AnalyzedGraph, layout: ChunkLayout, *, policy: str, slot_bytes: int, world: int = 1,
                 device_homes: int = 0, state_bytes: int = 0, host_room: int | None = None,
                 variants: dict[tuple, AnalyzedGraph] | None = None) -> Minimum:
    """The smallest budget some graph ``choose_activations`` picks under ``policy`` fits in:
    ``analyzed``'s own minimum, or (unless "keep") that of the graph with every segment taken off
    the device the policy's way ("auto": all recomputed, or all offloaded where the host has room),
    whichever is smallest. It does not depend on the measured rates, only the choice above it does."""
    def least(a: AnalyzedGraph) -> Minimum:
        return minimum_budget(a, layout, nonmodel=a.nonmodel, slot_bytes=slot_bytes, world=world,
                              device_homes=device_homes, state_bytes=state_bytes)
    keep = least(analyzed)
    if policy == Activations.KEEP or not analyzed.captured.backward:
        return keep
    options = [keep]
    ways = (policy,) if policy != Activations.AUTO else (Activations.RECOMPUTE, Activations.OFFLOAD)  # auto's fallbacks
    for way in ways:
        try:
            options.append(least(choose_activations(analyzed, layout, policy=way, budget=0, slot_bytes=slot_bytes,
                                                    world=world, device_homes=device_homes, state_bytes=state_bytes,
                                                    host_room=host_room, variants=variants)))
        except ValueError:
            if policy != Activations.AUTO:   # the host cannot take them: "offload" says so, auto recomputes
                raise
    return min(options, key=lambda m: m.nbytes)


def config_least(analyzed: AnalyzedGraph, layout: ChunkLayout, config: Config, *, world: int = 1,
                 rank: int = 0, variants: dict[tuple, AnalyzedGraph] | None = None) -> int:
    """The least budget of one layout under ``config``, as the engine counts it: ``least_budget``
    with the chunks the host cannot hold on the device (their optimizer states with them) and the
    host room offloaded activations may use. ``analyzed`` carries this layout's gathered copies."""
    from pscompile.config import available_host_bytes
    from pscompile.memory.disk_states import STAGED_SETS
    from pscompile.optim.placement import host_shortfall_chunks, host_state_chunks
    slot_bytes = layout.chunk_size * config.dtype.itemsize
    state_bytes = 3 * 4 * layout.chunk_size
    disk = config.disk_dir is not None and world == 1      # the host's shortfall goes to disk, not the device
    homes = 0 if config.host_memory is None or world > 1 or disk else host_shortfall_chunks(
        num_chunks=layout.num_chunks, chunk_bytes=slot_bytes + state_bytes, host_budget=config.host_memory)
    host = config.host_memory if config.host_memory is not None else int(0.8 * available_host_bytes())
    n, cs = layout.num_chunks, layout.chunk_size            # host room for activations, as the engine counts it
    owned = (len(range(rank, n, world)) * cs if config.collectives == Collectives.PER_CHUNK and world > 1
             else (n - homes) * (cs // world))
    room = max(0, host - owned * (config.dtype.itemsize + 12))
    if disk and room == 0:
        room = max(0, host_state_chunks(num_chunks=n, chunk_size=cs, param_bytes=config.dtype.itemsize,
                                        staging_chunks=STAGED_SETS, host_budget=host)[1])
    return least_budget(analyzed, layout, policy=config.activations, slot_bytes=slot_bytes, world=world,
                        device_homes=homes, state_bytes=state_bytes, host_room=room, variants=variants).nbytes


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


def node_windows(captured: CapturedGraph, nonmodel: Sequence[int]) -> tuple[int, ...]:
    """Per node of the captured graph, the non-model bytes its chunks must fit next to
    (``passes.plan_residency.arrival_windows``): parameter views and the output do not execute at
    their place in the scheduled graph, everything else does."""
    return arrival_windows(nonmodel, executed_nodes(captured))


def executed_nodes(captured: CapturedGraph) -> list[bool]:
    """Per node of the captured graph, whether it executes at its place in a scheduled graph
    (parameter views are rebuilt right before each reader; the output runs nothing)."""
    return list(captured.executed)


def node_reads(captured: CapturedGraph, layout: ChunkLayout, *,
               hold_grads: Mapping[str, int] | None = None) -> list[list[int]]:
    """Per node of the captured graph, the chunks it reads (through parameter views), in order.

    ``hold_grads`` (ZeRO: fqn -> the node after which its gradient is stored): a gathered group
    takes its gradients in its own slot and can leave the device only once all of them are there
    (they are reduce-scattered then), so it counts as read by every node from its first gradient
    store to its last."""
    reads = []
    chunks_of: dict[str, tuple[int, ...]] = {}
    for fqns in captured.param_reads:
        chunks: list[int] = []
        for fqn in fqns:
            if fqn not in chunks_of:
                chunks_of[fqn] = tuple(layout.entry(fqn).chunks)
            for c in chunks_of[fqn]:
                if c not in chunks:
                    chunks.append(c)
        reads.append(chunks)
    held: dict[int, tuple[int, int]] = {}
    for fqn, at in (hold_grads or {}).items():
        for c in layout.entry(fqn).chunks:
            lo, hi = held.get(c, (at, at))
            held[c] = (min(lo, at), max(hi, at))
    for c, (lo, hi) in held.items():
        for i in range(lo, hi + 1):
            if c not in reads[i]:
                reads[i].append(c)
    return reads


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
    needs when ``memory.budget`` is too small."""
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
                   start: Mapping[int, int] | None = None) -> Scheduled:
    """The schedule the compiled engine plans for ``analyzed`` at ``budget``: the activation
    policy's choice for the budget (``activations``: a ``Config.activations`` value; None plans
    ``analyzed`` as it is; ``variants`` as in ``choose_activations``), optimizer states placed by
    ``optim.placement`` for the curve's peak (on the host with ZeRO), then ``build_schedule``.
    ``measured`` (default: whether ``nonmodel`` was given) plans as after the measuring step;
    ``lookahead`` and ``start`` as in ``build_schedule`` (a training step of one rank that fetches
    the next step's first chunks after their update, and the step that starts with them)."""
    if activations is not None:
        slot = layout.chunk_size * torch.empty((), dtype=dtype).element_size()
        analyzed = choose_activations(analyzed, layout, policy=activations, budget=budget, slot_bytes=slot,
                                      world=world, variants=variants, rates=rates, host_room=host_room)
    nonmodel = analyzed.nonmodel if nonmodel is None else tuple(nonmodel)
    slot_bytes = layout.chunk_size * torch.empty((), dtype=dtype).element_size()
    state_bytes = 3 * layout.chunk_size * 4                  # fp32 master, exp_avg, exp_avg_sq
    count = device_state_chunks(budget=budget, peak_nonmodel=max(nonmodel), num_chunks=layout.num_chunks,
                                chunk_size=layout.chunk_size, param_chunk_bytes=slot_bytes,
                                state_chunk_bytes=state_bytes) if world == 1 else 0
    memory = DeviceMemory(budget, slot_bytes, frozenset(range(count)), count * state_bytes, world=world, rank=rank,
                          per_chunk=per_chunk)
    measured = nonmodel is not analyzed.nonmodel if measured is None else measured
    return build_schedule(analyzed, layout, nonmodel=nonmodel, memory=memory, dtype=dtype, kind=kind,
                          measured=measured, plan_only=plan_only, planner=planner, lookahead=lookahead,
                          start=start)


def describe_node(node: fx.Node) -> str:
    """``node NAME (TARGET, module path)`` for error messages."""
    stack = node.meta.get("nn_module_stack")
    where = ""
    if stack:
        where = ", " + list(stack.values())[-1][0]
    return f"node {node.name} ({node.target}{where})"
