"""The pipeline's first stage and the records every stage shares (``graph/pipeline.py`` runs them
in order): capture and analysis of one training iteration, the schedule records, and the
questions later stages ask of an analysed graph (which chunks a node reads, the non-model window
the chunks must fit beside, where each gradient is stored, how a spanning tensor is gathered).

    capture_and_analyze(model, batch, params=, dtype=, backward=)          -> AnalyzedGraph
        capture_joint      forward + loss (+ backward) as one FX graph on fake tensors
        annotate_params    which node reads which parameter; last uses; phases
        estimate_nonmodel  static non-model bytes per node (gradients die at their store)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn

from pscompile.graph.capture import CapturedGraph, capture_joint
from pscompile.graph.dynamic import at_bound, monotone
from pscompile.kinds import RunKind
from pscompile.memory.layout import ChunkLayout
from pscompile.passes.annotate_params import ParamUses, annotate_params
from pscompile.passes.estimate_nonmodel import estimate_nonmodel
from pscompile.passes.plan_lookahead import Lookahead
from pscompile.passes.plan_residency import GradStore, ResidencyPlan, arrival_windows
from pscompile.passes.recompute_activations import ActivationPlan


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
    # ZeRO: groups (per chunk: owned chunks) whose home on this rank -- fp32 master, Adam states and
    # a gradient buffer, in os_device_bytes -- is its device: their shard crosses no link
    device_shards: frozenset[int] = frozenset()
    # chunks whose parameters live on the disk tier: each fetch gets a disk_read ahead of it
    param_disk: frozenset[int] = frozenset()
    # bytes one fetch of each chunk moves over the link (``model_bytes.fetch_bytes``: an NF4 chunk's
    # are its packed bytes); empty: ``slot_bytes`` each
    fetch_bytes: tuple[int, ...] = ()

    def moved(self, c: int) -> int:
        """Bytes a fetch of chunk ``c`` moves over the link."""
        return self.fetch_bytes[c] if self.fetch_bytes else self.slot_bytes


@dataclass(frozen=True)
class Scheduled:
    """One schedule: the plan, the rewritten graph, and how they were made."""

    captured: CapturedGraph
    plan: ResidencyPlan
    gm: fx.GraphModule | None          # None: planned only (``PlanRequest(plan_only=True)``)
    nonmodel: tuple[int, ...]          # per node of the captured graph, the curve planned with
    measured: bool                     # that curve was measured (else: the static estimate)
    passes: tuple[PassTiming, ...]
    kind: RunKind = RunKind.TRAIN
    os_device: frozenset[int] = frozenset()   # chunks whose optimizer states were on the device
    activations: ActivationPlan | None = None  # the analyzed graph's recomputation and offloading
    offload_bytes: int = 0                     # saved activations the graph sends to the host (and back)
    lookahead: Lookahead | None = None         # training: chunks fetched for the next step after their update
    request: Any = None                        # the ``PlanRequest`` it was planned for


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


def analyze_at_bound(captured: CapturedGraph, bound: tuple[int, ...], *,
                     gathers: Mapping[str, int] | None = None) -> AnalyzedGraph:
    """A symbolic capture (``capture_joint(dynamic=...)``) analyzed at the range's upper bound: its
    graph (the same code, which runs any size) with the fake values of ``bound``
    (``dynamic.at_bound``), then the analyses every capture gets."""
    sym = captured.symbolic
    assert sym is not None, "analyze_at_bound takes a capture made with dynamic sizes"
    offset = captured.num_params + len(captured.buffer_fqns)
    passes = _Passes()
    concrete = passes.run("at_bound", lambda: replace(captured, gm=at_bound(captured.gm,
                                                                            sym.concrete_inputs(offset, bound))),
                          lambda c: f"at_bound: the fake values of sizes {list(bound)}")
    return _analyze(concrete, passes, gathers=gathers)


def range_refusal(captured: CapturedGraph) -> str | None:
    """Why a symbolic capture (``capture_joint(dynamic=...)``) cannot serve its range, or None: tracing
    specialized a size that changes, or a tensor's memory is not shown to grow with the sizes
    (``dynamic.monotone``: then the plan at the bound would not hold below it)."""
    sym = captured.symbolic
    offset = captured.num_params + len(captured.buffer_fqns)
    if not sym.still_symbolic(offset):
        return "tracing specialized a size that changes (" + ", ".join(str(g.expr) for g in sym.shape_env.guards) + ")"
    grows = monotone(captured.gm, offset, sym.dims)
    if grows is not None:
        return f"the memory of node {grows} is not shown to grow with the sizes"
    return None


def guards_refuse_bound(captured: CapturedGraph, bound: tuple[int, ...]) -> str | None:
    """The shape guards of a symbolic capture, when batches at ``bound`` break them (a model's
    ``assert T <= seq_len`` below a Dim's max): a plan at that bound keeps room no batch of the range
    uses, and batches that large get plans of their own. None when the bound is admitted."""
    sym = captured.symbolic
    offset = captured.num_params + len(captured.buffer_fqns)
    if sym.admits(sym.concrete_inputs(offset, bound)[offset:], offset):
        return None
    return ", ".join(str(g.expr) for g in sym.shape_env.guards)


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


def describe_node(node: fx.Node) -> str:
    """``node NAME (TARGET, module path)`` for error messages."""
    stack = node.meta.get("nn_module_stack")
    where = ""
    if stack:
        where = ", " + list(stack.values())[-1][0]
    return f"node {node.name} ({node.target}{where})"
