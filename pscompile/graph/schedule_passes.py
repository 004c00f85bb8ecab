"""The pipeline's second stage: the scheduling passes, one signature each, run from a list.

A schedule is asked for with a ``PlanRequest`` (what it is planned for: budget, dtype, kind of
run, ranks, policies), planned over an ``AnalyzedGraph`` and a ``ChunkLayout``, beside a
``DeviceMemory`` (what the device holds besides the planned chunks) and a non-model curve.

Every pass is a ``SchedulePass``: its name, the requests it applies to, and a function

    run(inputs: ScheduleInputs, state: ScheduleState) -> (ScheduleState, summary)

over two frozen records: ``ScheduleInputs`` (what every pass reads and none changes) and
``ScheduleState`` (what the passes so far made: the residency plan, the lookahead, the rewritten
graph, the verifier's report). ``run_schedule_passes`` runs ``SCHEDULE_PASSES`` in order and
stamps each with its provenance (``PassTiming``: name, seconds, summary), which the ``Scheduled``
record carries and the printed schedule lists. Adding a pass is one function and one row.

    plan_residency       Belady (or ANGEL-PTM) residency of every chunk at every node, static slots
    early_drops          each drop right after the last read of its chunk (not where its slot is next needed)
    prefetch_fetches     fetches start as early as capacity allows, a wait where they were
    overlap_grad_copies  (a measured micro-batch of accumulation) each gradient's copy to the host
                         runs while later nodes compute; the gradient held until its wait
    plan_lookahead       (training, host-updated chunks) the chunks fetched for the next step
    plan_early_updates   (training, host-updated chunks) an update node after each chunk's last drop
                         in the backward: its AdamW step starts while the backward goes on
    insert_memory_ops    the scheduled graph: memory nodes, parameters read as slot views
    verify_schedule      the invariants, replayed symbolically
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import torch
from torch import fx

from pscompile.errors import BudgetError, ResidencyError
from pscompile.graph.analysis import (
    AnalyzedGraph,
    DeviceMemory,
    PassTiming,
    Scheduled,
    describe_node,
    grad_stores,
    node_reads,
    node_windows,
)
from pscompile.graph.meta import storage_bytes
from pscompile.graph.ops import activation_move, is_memory_node, is_offload
from pscompile.config import Config
from pscompile.kinds import Activations, Collectives, MemKind, Policy, RunKind
from pscompile.memory.disk_homes import READ_AHEAD as DISK_READ_DEPTH
from pscompile.memory.layout import ChunkLayout
from pscompile.passes.early_drops import early_drops
from pscompile.passes.insert_memory_ops import insert_memory_ops
from pscompile.passes.overlap_grad_copies import overlap_grad_copies
from pscompile.passes.plan_disk_reads import plan_disk_reads
from pscompile.passes.plan_early_updates import plan_early_updates
from pscompile.passes.plan_lookahead import Lookahead, plan_lookahead
from pscompile.passes.plan_residency import GradStore, ResidencyPlan, plan_residency
from pscompile.passes.prefetch_fetches import prefetch_fetches
from pscompile.passes.verify_schedule import VerifyReport, verify_schedule
from pscompile.units import format_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What one schedule is planned for (the capture, the layout and the measurements aside).

    ``activations``: ``choose_activations``' policy for the budget (None: the graph as analyzed).
    ``measured``: the curve planned with was measured (a running engine's), which adds the passes
    only measured schedules run (``overlap_grad_copies``). ``lookahead``: a training step of one
    rank whose chunks the host updates fetches the next step's first chunks after their update;
    with ``start`` (chunk -> slot resident when the run starts) it is that next step's plan.
    ``host_room``: host bytes offloaded activations may use. ``plan_only``: stop after planning
    (no graph; for weighing plans by their traffic). ``device_states``: optimizer states may live
    on the device (False: every chunk's are on the host or disk, as with parameters on disk).
    ``device_homes``: how many of this rank's first chunks (ZeRO: its shards of the first groups,
    or the first chunks it owns) are homed on the device because the host cannot hold them.
    ``early_updates``: the most chunks whose update starts in the backward (``plan_early_updates``)."""

    budget: int | None
    dtype: torch.dtype
    kind: RunKind = RunKind.TRAIN
    world: int = 1
    rank: int = 0
    per_chunk: bool = False
    activations: Activations | None = None
    planner: Policy = Policy.BELADY
    measured: bool = False
    lookahead: bool = False
    start: tuple[tuple[int, int], ...] | None = field(default=None)
    host_room: int | None = None
    plan_only: bool = False
    device_states: bool = True
    device_homes: int = 0
    param_disk_chunks: int = 0     # one rank: how many of the last chunks keep their parameters on disk
    early_updates: int = 0         # training, one rank, host states: at most this many chunks' updates
                                   # start in the backward (plan_early_updates; 0: none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", RunKind(self.kind))
        object.__setattr__(self, "planner", Policy(self.planner))
        if self.activations is not None:
            object.__setattr__(self, "activations", Activations(self.activations))
        if isinstance(self.start, Mapping):
            object.__setattr__(self, "start", tuple(sorted(self.start.items())))

    @staticmethod
    def for_config(config: Config, *, budget: int | None, kind: RunKind = RunKind.TRAIN, world: int = 1,
                   rank: int = 0, per_chunk: bool | None = None, **more) -> "PlanRequest":
        """The request compiled mode makes under ``config``: its dtype, activation policy, planner
        and (``per_chunk`` None) collectives; ``more``: the other fields."""
        if per_chunk is None:
            per_chunk = config.collectives == Collectives.PER_CHUNK and world > 1
        return PlanRequest(budget, config.dtype, RunKind(kind), world, rank, per_chunk,
                           activations=config.activations, planner=config.planner, **more)

    @property
    def start_slots(self) -> dict[int, int] | None:
        return None if self.start is None else dict(self.start)

    @property
    def ahead(self) -> bool:
        """The plan starts with the chunks a lookahead fetched (the step after a lookahead)."""
        return self.lookahead and self.kind is RunKind.TRAIN and self.start is not None


@dataclass(frozen=True)
class ScheduleInputs:
    """What every scheduling pass reads."""

    analyzed: AnalyzedGraph
    layout: ChunkLayout
    request: PlanRequest
    memory: DeviceMemory
    nonmodel: tuple[int, ...]
    nodes: tuple[fx.Node, ...]
    windows: tuple[int, ...]                       # per node: the non-model bytes chunks fit beside
    stores: Mapping[int, Sequence[GradStore]]      # node -> the gradients stored right after it
    reads: tuple[tuple[int, ...], ...]             # per node: the chunks it reads (``analysis.node_reads``)

    @staticmethod
    def of(analyzed: AnalyzedGraph, layout: ChunkLayout, request: PlanRequest, *, nonmodel: Sequence[int],
           memory: DeviceMemory) -> "ScheduleInputs":
        captured = analyzed.captured
        nonmodel = tuple(nonmodel)
        elsize = torch.empty((), dtype=request.dtype).element_size()
        stores: dict[int, list[GradStore]] = {}
        for fqn, at in analyzed.grad_store_points.items():
            stores.setdefault(at, []).extend(grad_stores(layout.entry(fqn), elsize))
        reads = node_reads(captured, layout, hold_grads=analyzed.grad_store_points if memory.world > 1 else None)
        return ScheduleInputs(analyzed, layout, request, memory, nonmodel, tuple(captured.gm.graph.nodes),
                              tuple(node_windows(captured, nonmodel)), stores, tuple(map(tuple, reads)))


@dataclass(frozen=True)
class ScheduleState:
    """What the passes so far made."""

    plan: ResidencyPlan | None = None
    lookahead: Lookahead | None = None
    gm: fx.GraphModule | None = None
    report: VerifyReport | None = None


PassFn = Callable[[ScheduleInputs, ScheduleState], tuple[ScheduleState, str]]


def _always(request: PlanRequest) -> bool:
    return True


@dataclass(frozen=True)
class SchedulePass:
    """One pass of the second stage: its name, the requests it applies to, and what it does."""

    name: str
    run: PassFn
    applies: Callable[[PlanRequest], bool] = _always


# ------------------------------------------------------------------ the passes

def _residency(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    r, m = x.request, x.memory
    warm = r.kind.keeps_warm
    try:
        plan = plan_residency(
            x.reads, x.nonmodel, stores=x.stores, num_chunks=x.layout.num_chunks, slot_bytes=m.slot_bytes,
            budget=m.budget, os_device_chunks=m.os_device_chunks, os_device_bytes=m.os_device_bytes,
            accumulate=r.kind is RunKind.ACCUM, start=r.start_slots, keep_at_end=warm,
            end=r.start_slots if warm else None, start_in_flight=r.ahead,
            describe_node=lambda i: describe_node(x.nodes[i]), windows=x.windows, world=m.world, rank=m.rank,
            per_chunk=m.per_chunk, policy=r.planner, device_shards=m.device_shards,
            fetch_bytes=m.fetch_bytes or None)
    except ResidencyError as e:          # (not chained: the first node that failed names another figure)
        raise _budget_error(x, e) from None
    return replace(s, plan=plan), plan.summary(m.budget)


def _budget_error(x: ScheduleInputs, e: ResidencyError) -> BudgetError:
    """The budget is too small: below the model's minimum (named, with what would work), or
    enough for every node's chunks but not beside these optimizer states."""
    from pscompile.graph.minimum import minimum_budget
    budget = x.memory.budget
    least = minimum_budget(x.analyzed, x.layout, nonmodel=x.nonmodel, slot_bytes=x.memory.slot_bytes,
                           world=x.memory.world)
    if budget >= least.nbytes:
        return BudgetError(f"{e} (device_memory={format_bytes(budget)})")
    return BudgetError(f"device_memory={format_bytes(budget)} ({budget} bytes) is below the minimum "
                       f"{format_bytes(least.nbytes)} ({least.nbytes} bytes) this model needs: "
                       f"{least.describe(list(x.nodes))}; give device_memory >= {least.nbytes} (with chunk_size="
                       f"{x.layout.chunk_size}), a smaller batch or mode='hooks'", minimum=least.nbytes)


def _early_drops(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    plan, moved = early_drops(s.plan, x.reads)
    return replace(s, plan=plan), f"early_drops: {moved} drops moved up to the last read of their chunk"


def _prefetch(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    plan, report = prefetch_fetches(s.plan, x.nonmodel, budget=x.memory.budget,
                                    os_device_bytes=x.memory.os_device_bytes, windows=x.windows)
    return replace(s, plan=plan), report.summary


def _overlap_grads(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    captured = x.analyzed.captured
    out = next(n for n in reversed(x.nodes) if n.op == "output")
    held = {f: storage_bytes(g) for f, g in zip(captured.grad_fqns, out.args[0][1:])
            if isinstance(g, fx.Node) and storage_bytes(g) is not None}
    plan, report = overlap_grad_copies(s.plan, x.windows, budget=x.memory.budget,
                                       os_device_bytes=x.memory.os_device_bytes, grad_bytes=held)
    return replace(s, plan=plan), report.summary


def _lookahead(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    r, m = x.request, x.memory
    fixed = tuple((c, k) for c, k in r.start if c not in m.os_device_chunks) if r.ahead else None
    ahead = plan_lookahead(s.plan, x.windows, budget=m.budget, os_device_bytes=m.os_device_bytes,
                           os_device_chunks=m.os_device_chunks, fixed=fixed)
    # the step's bytes include the fetches it issues for the next step (after its update)
    plan = replace(s.plan, h2d_bytes=s.plan.h2d_bytes + sum(m.moved(c) for c, _ in ahead.fetches),
                   num_fetches=s.plan.num_fetches + len(ahead.fetches))
    return replace(s, plan=plan, lookahead=ahead), ahead.summary()


def _disk_reads(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    m = x.memory
    plan = plan_disk_reads(s.plan, m.param_disk, depth=DISK_READ_DEPTH, chunk_bytes=m.slot_bytes)
    reads = sum(1 for a in plan.actions if a.kind == MemKind.DISK_READ)
    return replace(s, plan=plan), f"plan_disk_reads: {reads} disk reads, {DISK_READ_DEPTH} fetches ahead"


def _early_updates(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    m = x.memory
    host = frozenset(range(x.layout.num_chunks)) - m.os_device_chunks - m.param_disk
    last_use: dict[int, int] = {}
    for i, chunks in enumerate(x.reads):          # (one rank: no gradients held)
        for c in chunks:
            last_use[c] = i
    for i, stores in x.stores.items():           # (a gradient is stored right after node i)
        for g in stores:
            last_use[g.chunk] = max(last_use.get(g.chunk, -1), i)
    plan = plan_early_updates(s.plan, host, last_use, limit=x.request.early_updates)
    n = sum(1 for a in plan.actions if a.kind == MemKind.UPDATE)
    return replace(s, plan=plan), f"plan_early_updates: {n} chunks updated while the backward goes on"


def _insert(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    captured, m = x.analyzed.captured, x.memory
    gm = insert_memory_ops(captured.gm, s.plan, x.layout, param_fqns=captured.param_fqns,
                           grad_fqns=captured.grad_fqns, compute_dtype=x.request.dtype, nonmodel=x.nonmodel,
                           world=m.world, rank=m.rank, per_chunk=m.per_chunk)
    count = sum(1 for n in gm.graph.nodes if is_memory_node(n))
    return replace(s, gm=gm), f"insert_memory_ops: {count} memory nodes"


def _verify(x: ScheduleInputs, s: ScheduleState) -> tuple[ScheduleState, str]:
    r, m = x.request, x.memory
    report = verify_schedule(
        s.gm, x.layout, slot_bytes=m.slot_bytes, budget=m.budget, initial=dict(s.plan.initial),
        os_device_chunks=m.os_device_chunks, os_device_bytes=m.os_device_bytes,
        final=dict(s.plan.final) if r.kind.keeps_warm else None, world=m.world,
        grad_fqns=x.analyzed.captured.grad_fqns if r.kind.backward else (), per_chunk=m.per_chunk,
        arriving=frozenset(k for c, k in r.start if c not in m.os_device_chunks) if r.ahead else frozenset(),
        disk_chunks=m.param_disk, disk_depth=DISK_READ_DEPTH)
    return replace(s, report=report), report.summary(m.budget)


SCHEDULE_PASSES: tuple[SchedulePass, ...] = (
    SchedulePass("plan_residency", _residency),
    SchedulePass("early_drops", _early_drops),
    SchedulePass("prefetch_fetches", _prefetch),
    # the measuring run keeps each gradient's death where the graph has it
    SchedulePass("overlap_grad_copies", _overlap_grads, lambda r: r.kind is RunKind.ACCUM and r.measured),
    SchedulePass("plan_lookahead", _lookahead, lambda r: r.lookahead and r.kind is RunKind.TRAIN),
    SchedulePass("plan_disk_reads", _disk_reads, lambda r: r.param_disk_chunks > 0),
    SchedulePass("plan_early_updates", _early_updates,
                 lambda r: r.early_updates > 0 and r.kind is RunKind.TRAIN and r.world == 1),
    SchedulePass("insert_memory_ops", _insert, lambda r: not r.plan_only),
    SchedulePass("verify_schedule", _verify, lambda r: not r.plan_only),
)


def run_schedule_passes(inputs: ScheduleInputs, passes: Sequence[SchedulePass] = SCHEDULE_PASSES
                        ) -> tuple[ScheduleState, tuple[PassTiming, ...]]:
    """Run the ``passes`` that apply to ``inputs.request`` in order; the state they leave and the
    provenance of each (after the analyzed graph's own)."""
    state, timings = ScheduleState(), list(inputs.analyzed.passes)
    for p in passes:
        if not p.applies(inputs.request):
            continue
        t0 = time.perf_counter()
        state, summary = p.run(inputs, state)
        timings.append(PassTiming(p.name, time.perf_counter() - t0, summary))
    return state, tuple(timings)


def build_schedule(analyzed: AnalyzedGraph, layout: ChunkLayout, request: PlanRequest, *,
                   nonmodel: Sequence[int], memory: DeviceMemory,
                   passes: Sequence[SchedulePass] = SCHEDULE_PASSES) -> Scheduled:
    """Plan, rewrite and verify one schedule of ``analyzed`` for ``request`` beside ``memory``.

    Accumulation and evaluation runs update nothing, so they keep clean chunks resident at the
    end for the next run; ``request.start`` plans the warm variant, which starts from that
    residency and ends with it again. Raises ``BudgetError`` naming the node and the budget it
    needs when ``memory.budget`` is too small."""
    inputs = ScheduleInputs.of(analyzed, layout, request, nonmodel=nonmodel, memory=memory)
    state, timings = run_schedule_passes(inputs, passes)
    gm = state.gm
    offloaded = analyzed.activations.offload_bytes if analyzed.activations else 0
    if gm is not None:
        offloaded = sum(activation_move(n).nbytes for n in gm.graph.nodes if is_offload(n))
    return Scheduled(analyzed.captured, state.plan, gm, inputs.nonmodel, request.measured, timings, request.kind,
                     memory.os_device_chunks, analyzed.activations, offloaded, state.lookahead, request)
