"""The program an executor runs (``compiled/executor.py``): its steps, built one per node or by
regions between memory nodes, and when each value is released.

``per_node``: every node is a step. ``by_regions``, in five phases over the scheduled graph:
assign the nodes to steps (a memory node cuts, a region runs between), build each region's own
graph, describe each region's inputs (the layouts it is compiled for, its structural key), compile
each through the ``RegionCache`` (or wrap it as eager code), and interleave the steps with the
values the executor evaluates itself (parameter and buffer views) right before their first
reader. ``release_plan`` then marks each value's last reader.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import fx

from pscompile.compiled.probe import warn_fallback
from pscompile.compiled.inductor import SymbolicMeta, compile_inductor
from pscompile.graph.dynamic import has_symbols
from pscompile.compiled.regions import (Region, RegionCache, TensorMeta, buffer_aliases, buffer_placeholders,
                                        eval_chain, fusible_ops, graph_device, is_view_op,
                                        lifted_views, region_key, written_inputs)
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import copy_grad_into, folds_into_region, is_memory_node, runs_as_transfer
from pscompile.kinds import Backend, Phase, StrEnum
from pscompile.profiling import NOTHING as _NOTHING

aten = torch.ops.aten

__all__ = ["LoweringReport", "Step", "StepKind", "attr", "by_regions", "first_backward", "is_compute_op", "per_node",
           "release_plan", "run_deferred"]


@dataclass(frozen=True)
class LoweringReport:
    regions: int            # compute regions (steps between memory nodes)
    compiled: int           # regions run through the backend (the rest: nothing to fuse, eager)
    distinct: int           # distinct compiled regions (by structural hash) in this graph
    compiled_now: int       # distinct regions compiled for this graph (cache misses)
    cache_hits: int         # compiled regions served by the RegionCache
    compile_s: float        # seconds spent compiling (this graph's misses)
    memory_nodes: int
    lifted_views: int       # parameter views (slice/view of a slot) made by the executor
    rebuilt_views: int      # buffer views re-created in a later region (should be 0)
    moved_getitems: int     # getitems moved back into their op's region
    backend: str
    unboxed: int = 0        # compiled regions called unboxed (inputs alive to the region's end; want 0)
    fallbacks: int = 0      # regions to be compiled that run as eager code (Region.fallback says why)

    def summary(self) -> str:
        return (f"lower_regions: {self.regions} regions, {self.compiled} compiled, {self.distinct} distinct "
                f"({self.compiled_now} compiled now, {self.cache_hits} cache hits), {self.memory_nodes} memory "
                f"nodes, backend {self.backend}, compiled in {self.compile_s:.1f} s")


class StepKind(StrEnum):
    INPUT = "input"      # a placeholder (split="nodes" only, so an observer sees it)
    REGION = "region"    # a compute region (split="regions")
    MEM = "mem"          # a memory node, handed to run_memory
    EVAL = "eval"        # one node evaluated by the executor (a compute node, or a parameter view)


@dataclass
class Step:
    kind: StepKind
    region: Region | None = None
    node: fx.Node | None = None
    free: tuple[fx.Node, ...] = ()        # values released after this step
    dead: tuple[fx.Node, ...] = ()        # values this step makes that nobody reads
    allocates: bool = True                 # EVAL: the value may be new memory (not a view, not an item)
    # EVAL: a view of a device slot (a parameter the executor lifts out of a region): kept between
    # runs and made again only when the slot tensor is another one (a slot's storage is resized
    # as it takes and gives up chunks, and a view follows its storage: the view stays valid)
    memo: bool = False

    def reads(self) -> Iterable[fx.Node]:
        if self.kind is StepKind.REGION:
            r = self.region
            return (*r.inputs, *(a for n in r.deferred for a in n.all_input_nodes)) if r.deferred else r.inputs
        return self.node.all_input_nodes if self.kind is not StepKind.INPUT else ()

    def makes(self) -> Iterable[fx.Node]:
        if self.kind is StepKind.REGION:
            return self.region.outputs
        if self.kind is StepKind.MEM:          # an activation's offload or reload makes a value
            return (self.node,) if self.node.users else ()
        return (self.node,) if self.kind is StepKind.EVAL else ()


def is_compute_op(n: fx.Node) -> bool:
    """An operator that computes (what ``StepStats.compute_ops`` counts): a called function that
    is not a memory node, a view, a ``getitem`` or a parameter's view or gather."""
    return (n.op == "call_function" and not is_memory_node(n) and not is_view_op(n)
            and n.target is not operator.getitem and gmeta.get(n, "param") is None)


def first_backward(nodes: Iterable[fx.Node]) -> fx.Node | None:
    """The first node of phase "bwd" (where the backward starts), or None."""
    return next((n for n in nodes if gmeta.get(n, "phase") == Phase.BWD), None)


def per_node(gm: fx.GraphModule) -> list[Step]:
    """One step per node, in graph order."""
    program = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            program.append(Step(StepKind.INPUT, node=n))
        elif runs_as_transfer(n):
            program.append(Step(StepKind.MEM, node=n))
        elif n.op in ("call_function", "get_attr"):
            program.append(Step(StepKind.EVAL, node=n))
        else:
            raise ValueError(f"executor: node {n.name} ({n.op}) is not supported; the scheduled graph "
                             "should only call functions")
    return program


def by_regions(gm: fx.GraphModule, *, backend: str, cache: RegionCache, lift_params: bool, min_fusible: int,
               device: torch.device | str | None, fold: bool = False, cuts: frozenset[int] = frozenset(),
               solo: frozenset[int] = frozenset(), symbolic: Sequence[Any] | None = None):
    """Regions between memory nodes, compiled through ``cache``; parameter views as eval steps
    right before their first reader. ``fold``: memory nodes that ``folds_into_region`` do not cut
    the graph; they are listed in their region's ``effects``. With ``backend="eager"`` the region
    runs them itself, in graph order; with a compiler, the executor runs them right after the
    region (``deferred``), since a compiler is not given a write into a graph input. That is
    exact: a gradient is stored after its parameter's last read (``grad_store_points``), so no node
    of the region reads the bytes a store overwrites; the gradient only lives until the region's
    end instead of until its store. ``cuts``: captured node indices (``src_index``) where a region
    ends before the node although no memory node is there (a region cut to fit the budget);
    ``solo``: nodes that run alone, as eager code (an operator that fits no other way).
    ``symbolic``: a range's schedule, the symbolic value of each node (``dynamic.symbolic_values``):
    region inputs whose sizes are symbols are described by ``SymbolicMeta``s and compiled once for
    every length (``compiled/inductor.py``). Returns (program, regions, report, input checks)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    buffers = buffer_placeholders(gm)
    aliases = buffer_aliases(gm, buffers)
    lifted = lifted_views(gm, buffers) if lift_params else set()
    lifted |= {n for n in nodes if n.op == "get_attr"}      # constants: evaluated by the executor, passed in
    cut = _assign(nodes, lifted, fold=fold, defer=backend != Backend.EAGER, cuts=cuts, solo=solo)
    rebuilt = sum(_build_graph(r, cut.region_of, aliases, lifted, min_fusible) for r in cut.regions)
    # buffer views read by a memory node or the output: evaluated by the executor
    evals = {n for n in nodes if n in aliases and n not in lifted
             and any(u.op == "output" or is_memory_node(u) for u in n.users)}
    input_checks = _describe_inputs(gm, cut.regions, lifted, placeholders,
                                    device if device is not None else graph_device(nodes),
                                    dict(zip(nodes, symbolic)) if symbolic is not None else None)
    compiled = _compile(cut.regions, backend, cache)
    program = _interleave(cut.steps, placeholders, lifted | evals | aliases, output_node)
    report = LoweringReport(
        regions=len(cut.regions), compiled=sum(1 for r in cut.regions if r.compute and backend != Backend.EAGER),
        distinct=compiled.distinct, compiled_now=compiled.compiled_now, cache_hits=compiled.hits,
        compile_s=compiled.seconds, memory_nodes=cut.memory_nodes,
        lifted_views=sum(1 for n in lifted if n.op != "get_attr" and not any(u in lifted for u in n.users)),
        rebuilt_views=rebuilt, moved_getitems=cut.moved_getitems, backend=backend,
        unboxed=sum(1 for r in cut.regions if r.compute and backend != Backend.EAGER and r.fallback is None
                    and not getattr(r.fn, "_pscompile_boxed", False)),
        fallbacks=sum(1 for r in cut.regions if r.fallback is not None))
    return program, cut.regions, report, input_checks


@dataclass
class _Cut:
    """The graph's nodes assigned to steps: regions between memory nodes."""

    steps: list[Step] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    region_of: dict[fx.Node, Region] = field(default_factory=dict)
    moved_getitems: int = 0
    memory_nodes: int = 0


def _assign(nodes: list[fx.Node], lifted: set[fx.Node], *, fold: bool, defer: bool,
            cuts: frozenset[int] = frozenset(), solo: frozenset[int] = frozenset()) -> _Cut:
    """Assign every node to a step, in graph order (``by_regions``' docstring says what folds and
    what ``cuts`` and ``solo`` cut)."""
    cut = _Cut()
    cur: Region | None = None
    first_bwd = first_backward(nodes)
    for n in nodes:
        if n.op in ("placeholder", "output") or n in lifted:
            continue                                     # (lifted: made by the executor when needed)
        folds = fold and runs_as_transfer(n) and folds_into_region(n)
        if folds and defer and cur is not None:
            cur.effects.append(n)                        # run right after the region
            cur.deferred.append(n)
            continue
        if runs_as_transfer(n) and not (folds and not defer):
            cur = None
            cut.steps.append(Step(StepKind.MEM, node=n))
            cut.memory_nodes += 1
            continue
        if n.op != "call_function":
            raise ValueError(f"lower_regions: node {n.name} ({n.op}) is not supported; "
                             "the scheduled graph should only call functions")
        item = n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in cut.region_of
        if item and cut.region_of[n.args[0]] is not cur:
            r = cut.region_of[n.args[0]]                 # keep a tuple op with its getitems
            r.nodes.append(n)
            cut.region_of[n] = r
            cut.moved_getitems += 1
            continue
        src = gmeta.get(n, "src_index")
        if cur is not None and not item and (cur.solo or src in cuts or src in solo):
            cur = None                                   # a region cut to fit the budget
        if n is first_bwd and fold and defer:
            cur = None      # with stores folded, a compiled region ends where the backward starts: a cold
                            # compile of the two halves apart takes less than of both in one
        if cur is None:
            cur = Region(len(cut.regions), solo=src in solo and not item)
            cut.regions.append(cur)
            cut.steps.append(Step(StepKind.REGION, region=cur))
        cur.nodes.append(n)
        cut.region_of[n] = cur
        if runs_as_transfer(n):
            cur.effects.append(n)
    return cut


def _build_graph(r: Region, region_of: dict[fx.Node, Region], aliases: set[fx.Node], lifted: set[fx.Node],
                 min_fusible: int) -> int:
    """Region ``r``'s own graph, inputs and outputs; returns how many buffer views it re-creates."""
    g = fx.Graph()
    local: dict[fx.Node, fx.Node] = {}
    members = set(r.nodes)
    rebuilt = 0

    def get(a: fx.Node) -> fx.Node:
        nonlocal rebuilt
        if a in local:
            return local[a]
        if a in aliases and a not in lifted and a not in members:
            rebuilt += 1                  # a buffer view from another region: re-create its chain here
            v = g.node_copy(a, get)
            local[a] = v
            return v
        p = g.placeholder(f"in_{len(r.inputs)}")
        p.meta["val"] = a.meta.get("val")
        r.inputs.append(a)
        local[a] = p
        return p

    for n in r.nodes:
        local[n] = g.node_copy(n, get)
        if n in r.effects:                   # the op's body as a plain call (no op dispatch)
            local[n].target = copy_grad_into
    outs = []
    for n in r.nodes:
        if n in aliases:
            continue                  # views of buffers are re-made where they are read
        if isinstance(n.meta.get("val"), (tuple, list)) and not isinstance(n.meta.get("val"), torch.Size):
            continue                  # tuples never cross: their getitems are here
        if any(region_of.get(u) is not r for u in n.users):
            outs.append(n)
    r.outputs = outs
    r.held = list(dict.fromkeys(a for d in r.deferred for a in d.all_input_nodes if region_of.get(a) is not r))
    g.output(tuple(local[o] for o in outs))
    g.lint()
    r.graph = g
    r.ops = sum(1 for n in r.nodes if is_compute_op(n))
    r.compute = not r.solo and r.ops > 0 and fusible_ops(r.nodes) >= min_fusible
    r.written = written_inputs(g)
    return rebuilt


# outputs a CUDA kernel returns on the host: flash attention's RNG seed and offset (torch 2.11 on an
# H200, 2026-11-26: a region compiled for them on the GPU was given CPU tensors and fell back)
_HOST_OUTPUTS = {aten._scaled_dot_product_flash_attention.default: (6, 7)}


def _on_host(a: fx.Node, device: torch.device) -> bool:
    """``a`` is an output the kernel that makes it on ``device`` returns on the host (``_HOST_OUTPUTS``)."""
    src = a.args[0] if a.target is operator.getitem and a.args else None
    return device.type == "cuda" and isinstance(src, fx.Node) and a.args[1] in _HOST_OUTPUTS.get(src.target, ())


def _describe_inputs(gm: fx.GraphModule, regions: list[Region], lifted: set[fx.Node],
                     placeholders: list[fx.Node], device: torch.device | str,
                     symbolic: dict[fx.Node, Any] | None = None) -> tuple:
    """Each region's input layouts (exact strides and storage offsets of lifted parameter views)
    and structural key; returns what the graph's tensor inputs that compiled regions read must look
    like (they specialise on it; inputs only memory ops touch, host chunks and accumulation
    buffers, may be anything)."""
    meta_env: dict[fx.Node, Any] = {}

    def meta_value(a: fx.Node) -> Any:
        if a not in meta_env:
            if a.op == "get_attr":
                meta_env[a] = attr(gm, a.target)
            elif a in lifted:
                args = fx.node.map_arg(a.args, meta_value)
                kwargs = fx.node.map_arg(a.kwargs, meta_value)
                meta_env[a] = a.target(*args, **kwargs)
            else:
                v = a.meta.get("val")
                meta_env[a] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") \
                    if a.op == "placeholder" and isinstance(v, torch.Tensor) else v
                if _on_host(a, torch.device(device)):
                    meta_env[a] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
        return meta_env[a]

    def described(a: fx.Node) -> Any:
        bound = TensorMeta.of(meta_value(a), device)
        sym = symbolic.get(a) if symbolic is not None and a not in lifted else None
        return SymbolicMeta(sym, bound) if has_symbols(sym) else bound

    for r in regions:
        r.input_metas = [described(a) for a in r.inputs]
        r.key = region_key(r.graph, r.input_metas)
    read = {a for r in regions for a in r.inputs}
    return tuple((i, n.name, tuple(v.shape), tuple(v.stride()), v.dtype)
                 for i, n in enumerate(placeholders)
                 if n in read and isinstance(v := n.meta.get("val"), torch.Tensor))


@dataclass(frozen=True)
class _Compiled:
    hits: int
    compiled_now: int
    distinct: int
    seconds: float


def _compile(regions: list[Region], backend: str, cache: RegionCache) -> _Compiled:
    """Compile (or wrap as eager code) each region, through the cache."""
    t0 = time.perf_counter()
    hits = compiled_now = 0
    distinct: set[str] = set()
    for r in regions:
        if backend == Backend.EAGER or not r.compute:
            r.fn = r.eager()
            continue
        distinct.add(r.key)
        entry, hit = cache.get_or_compile(
            (backend, r.key), lambda r=r: compile_inductor(r.graph, r.input_metas))
        if hit:
            hits += 1
        else:
            compiled_now += 1
        if entry.fn is None:               # Inductor failed on it (or it failed when measured): eager code
            r.fallback, r.fn = entry.error, r.eager()
            if not hit:
                warn_fallback(r, "compiling", entry.error)
        else:
            r.fn = entry.fn
    return _Compiled(hits, compiled_now, len(distinct), time.perf_counter() - t0)


def _interleave(steps: list[Step], placeholders: list[fx.Node], eager_nodes: set[fx.Node],
                output_node: fx.Node) -> list[Step]:
    """The executor's program: each view or value the executor evaluates itself
    (``eager_nodes``) right before its first reader."""
    program: list[Step] = []
    produced: set[fx.Node] = set(placeholders)
    of_slots = {p for p in placeholders if gmeta.get(p, "slot") is not None}   # (and views of them)

    def ensure(reads: Iterable[fx.Node]) -> None:
        for a in reads:
            if a in produced or a not in eager_nodes:
                continue
            for x in eval_chain(a, eager_nodes):
                if x not in produced:
                    view = is_view_op(x)
                    step = Step(StepKind.EVAL, node=x, allocates=not (
                        view or x.op != "call_function" or x.target is operator.getitem))
                    top = [a for a in x.args if isinstance(a, fx.Node)]    # (no node inside a list)
                    if view and not x.kwargs and top and top == x.all_input_nodes and all(i in of_slots for i in top):
                        step.memo = True
                        of_slots.add(x)
                    program.append(step)
                    produced.add(x)

    for s in steps:
        ensure([*s.region.inputs, *s.region.held] if s.kind is StepKind.REGION else s.node.all_input_nodes)
        program.append(s)
        if s.kind is StepKind.REGION:
            produced.update(s.region.outputs)
    ensure(output_node.all_input_nodes)
    return program


def run_deferred(r: Region, env: dict[fx.Node, Any], held: dict[fx.Node, Any],
                 ranges: Callable[[fx.Node], ContextManager] | None = None) -> None:
    """The stores a region's step runs after the region, in graph order (each inside its profiler
    range, ``ranges(node)``, while a profiler records)."""
    def value(a: fx.Node) -> Any:
        return env[a] if a in env else held[a]

    for n in r.deferred:
        with ranges(n) if ranges is not None else _NOTHING:
            copy_grad_into(*fx.node.map_arg(n.args, value), **fx.node.map_arg(n.kwargs, value))


def attr(gm: fx.GraphModule, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def release_plan(program: list[Step], output_node: fx.Node) -> None:
    """Fill each step's ``free`` (values whose last reader it is) and ``dead`` (values it makes
    that nobody reads); the graph's outputs are kept."""
    last: dict[fx.Node, int] = {}
    made: dict[fx.Node, int] = {}
    for i, s in enumerate(program):
        for a in s.reads():
            last[a] = i
        for o in s.makes():
            made[o] = i
    keep = set(output_node.all_input_nodes)
    frees: dict[int, list[fx.Node]] = {}
    spent: dict[int, list[fx.Node]] = {}     # made and last read by one step (by its deferred stores)
    for a, i in last.items():
        if a not in keep:
            (spent if made.get(a) == i else frees).setdefault(i, []).append(a)
    for i, s in enumerate(program):
        s.free = tuple(frees.get(i, ()))
        s.dead = tuple(o for o in s.makes() if o not in last and o not in keep) + tuple(spent.get(i, ()))
