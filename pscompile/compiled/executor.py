"""The executor: runs a scheduled graph, memory nodes exactly as planned, compute in between.

One executor serves every way compiled mode runs a schedule. It turns the scheduled graph into a
*program* of steps and runs them in order, releasing every value after its last use:

    split="nodes"     every compute node is one step, run eagerly (the ``backend="eager"``
                      engine, and the warm-up step that measures each node's non-model bytes
                      through an observer);
    split="regions"   the graph is cut at its memory nodes into compute regions
                      (``regions.py``), each compiled once by Inductor (or wrapped eagerly with
                      ``backend="eager"``); parameter views are made by the executor right
                      before the region that reads them.

In both, a memory node is never run as an op: the executor calls ``run_memory(node, args)`` with
its evaluated arguments, and the engine performs the copy on its transfer queue and counts it.
Activation nodes (``offload`` / ``reload``) run the same way; what ``run_memory`` returns for them
is their value.
``run`` has the semantics of ``gm(*inputs)`` otherwise: it returns the graph's outputs.

Memory: ``split="nodes"`` frees exactly as ``fx.Interpreter(garbage_collect_values=True)`` does,
and a value nobody reads dies as soon as it is made, which is what ``estimate_nonmodel`` assumes.
Regions receive their inputs boxed (the list is cleared) so an input dies inside the region.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Protocol, Sequence

import torch
from torch import fx

from pscompile.graph import meta as gmeta
from pscompile.kinds import Backend, Phase, StrEnum
from pscompile.graph.ops import copy_grad_into, folds_into_region, is_memory_node, mem_op, runs_as_transfer
from pscompile.compiled.probe import warn_fallback
from pscompile.compiled.regions import (Region, RegionCache, TensorMeta, buffer_aliases, buffer_placeholders,
                                        check_region_args, compile_inductor, eval_chain, fusible_ops,
                                        graph_device, is_view_op, lifted_views, region_key,
                                        written_inputs)

__all__ = ["Executor", "LoweringReport", "NodeObserver", "Step", "StepKind", "lower_regions"]


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


class NodeObserver(Protocol):
    """Sees every step of ``split="nodes"``: ``before(node)`` right before it runs, ``after(node)``
    once its value exists and before the values it read last are released."""

    def before(self, node: fx.Node) -> None: ...

    def after(self, node: fx.Node) -> None: ...


def _first_backward(nodes: Iterable[fx.Node]) -> fx.Node | None:
    """The first node of phase "bwd" (where the backward starts), or None."""
    return next((n for n in nodes if gmeta.get(n, "phase") == Phase.BWD), None)


def _per_node(gm: fx.GraphModule) -> list[Step]:
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


def _by_regions(gm: fx.GraphModule, *, backend: str, cache: RegionCache, lift_params: bool, min_fusible: int,
                device: torch.device | str | None, fold: bool = False):
    """Regions between memory nodes, compiled through ``cache``; parameter views as eval steps
    right before their first reader. ``fold``: memory nodes that ``folds_into_region`` do not cut
    the graph; they are listed in their region's ``effects``. With ``backend="eager"`` the region
    runs them itself, in graph order; with a compiler, the executor runs them right after the
    region (``deferred``), since a compiler is not given a write into a graph input. That is
    exact: a gradient is stored after its parameter's last read (``grad_store_points``), so no node
    of the region reads the bytes a store overwrites; the gradient only lives until the region's
    end instead of until its store. Returns (program, regions, report, input checks)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    buffers = buffer_placeholders(gm)
    aliases = buffer_aliases(gm, buffers)
    lifted = lifted_views(gm, buffers) if lift_params else set()
    lifted |= {n for n in nodes if n.op == "get_attr"}      # constants: evaluated by the executor, passed in

    # ---- assign nodes to steps, in graph order
    steps: list[Step] = []
    regions: list[Region] = []
    region_of: dict[fx.Node, Region] = {}
    cur: Region | None = None
    defer = backend != Backend.EAGER
    first_bwd = _first_backward(nodes)
    moved = 0
    mem_count = 0
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n in lifted:
            continue                                     # made by the executor when needed
        folds = fold and runs_as_transfer(n) and folds_into_region(n)
        if folds and defer and cur is not None:
            cur.effects.append(n)                        # run right after the region
            cur.deferred.append(n)
            continue
        if runs_as_transfer(n) and not (folds and not defer):
            cur = None
            steps.append(Step(StepKind.MEM, node=n))
            mem_count += 1
            continue
        if n.op != "call_function":
            raise ValueError(f"lower_regions: node {n.name} ({n.op}) is not supported; "
                             "the scheduled graph should only call functions")
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in region_of \
                and region_of[n.args[0]] is not cur:
            r = region_of[n.args[0]]                     # keep a tuple op with its getitems
            r.nodes.append(n)
            region_of[n] = r
            moved += 1
            continue
        if n is first_bwd and fold and defer:
            cur = None      # with stores folded, a compiled region ends where the backward starts: a cold
                            # compile of the two halves apart takes less than of both in one
        if cur is None:
            cur = Region(len(regions))
            regions.append(cur)
            steps.append(Step(StepKind.REGION, region=cur))
        cur.nodes.append(n)
        region_of[n] = cur
        if runs_as_transfer(n):
            cur.effects.append(n)

    # ---- build region graphs
    rebuilt = 0
    for r in regions:
        g = fx.Graph()
        local: dict[fx.Node, fx.Node] = {}
        members = set(r.nodes)

        def get(a: fx.Node, g=g, local=local, r=r, members=members) -> fx.Node:
            nonlocal rebuilt
            if a in local:
                return local[a]
            if a in aliases and a not in lifted and a not in members:
                # a buffer view from another region: re-create its chain here
                rebuilt += 1
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
        r.compute = fusible_ops(r.nodes) >= min_fusible
        r.written = written_inputs(g)

    # ---- buffer views read by a memory node or the output: evaluated by the executor
    evals = {n for n in nodes if n in aliases and n not in lifted
             and any(u.op == "output" or is_memory_node(u) for u in n.users)}
    eager_nodes = lifted | evals | aliases

    # ---- input metadata (exact strides / storage offsets of lifted parameter views)
    device = device if device is not None else graph_device(nodes)
    meta_env: dict[fx.Node, Any] = {}

    def meta_value(a: fx.Node) -> Any:
        if a not in meta_env:
            if a.op == "get_attr":
                meta_env[a] = _attr(gm, a.target)
            elif a in lifted:
                args = fx.node.map_arg(a.args, meta_value)
                kwargs = fx.node.map_arg(a.kwargs, meta_value)
                meta_env[a] = a.target(*args, **kwargs)
            else:
                v = a.meta.get("val")
                meta_env[a] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") \
                    if a.op == "placeholder" and isinstance(v, torch.Tensor) else v
        return meta_env[a]

    for r in regions:
        r.input_metas = [TensorMeta.of(meta_value(a), device) for a in r.inputs]
        r.key = region_key(r.graph, r.input_metas)
    # what the graph's tensor inputs that compiled regions read must look like (they specialise on
    # it); inputs only memory ops touch (host chunks, accumulation buffers) may be anything
    read = {a for r in regions for a in r.inputs}
    input_checks = tuple(
        (i, n.name, tuple(v.shape), tuple(v.stride()), v.dtype)
        for i, n in enumerate(placeholders)
        if n in read and isinstance(v := n.meta.get("val"), torch.Tensor))

    # ---- compile (or wrap) each region, through the cache
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
    compile_s = time.perf_counter() - t0

    # ---- executor program: eager views right before their first reader, frees after last use
    program: list[Step] = []
    produced: set[fx.Node] = set(placeholders)

    def ensure(reads: Iterable[fx.Node]) -> None:
        for a in reads:
            if a in produced or a not in eager_nodes:
                continue
            for x in eval_chain(a, eager_nodes):
                if x not in produced:
                    program.append(Step(StepKind.EVAL, node=x, allocates=not (
                        is_view_op(x) or x.op != "call_function" or x.target is operator.getitem)))
                    produced.add(x)

    for s in steps:
        ensure([*s.region.inputs, *s.region.held] if s.kind is StepKind.REGION else s.node.all_input_nodes)
        program.append(s)
        if s.kind is StepKind.REGION:
            produced.update(s.region.outputs)
    ensure(output_node.all_input_nodes)

    report = LoweringReport(
        regions=len(regions), compiled=sum(1 for r in regions if r.compute and backend != Backend.EAGER),
        distinct=len(distinct), compiled_now=compiled_now, cache_hits=hits, compile_s=compile_s,
        memory_nodes=mem_count, lifted_views=sum(1 for n in lifted if n.op != "get_attr" and not any(u in lifted for u in n.users)),
        rebuilt_views=rebuilt, moved_getitems=moved, backend=backend,
        unboxed=sum(1 for r in regions if r.compute and backend != Backend.EAGER and r.fallback is None
                    and not getattr(r.fn, "_pscompile_boxed", False)),
        fallbacks=sum(1 for r in regions if r.fallback is not None))
    return program, regions, report, input_checks


def _run_deferred(r: Region, env: dict[fx.Node, Any], held: dict[fx.Node, Any]) -> None:
    """The stores a region's step runs after the region, in graph order."""
    def value(a: fx.Node) -> Any:
        return env[a] if a in env else held[a]

    for n in r.deferred:
        copy_grad_into(*fx.node.map_arg(n.args, value), **fx.node.map_arg(n.kwargs, value))


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _release_plan(program: list[Step], output_node: fx.Node) -> None:
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


class Executor:
    """Runs one scheduled graph (see the module doc).

    - ``split``: "nodes" (each compute node a step, eager) or "regions" (compute regions).
    - ``backend``: regions only: "inductor" compiles them, "eager" runs the same split uncompiled.
    - ``cache``: a RegionCache to share (default: a new one).
    - ``lift_params``: parameter views are region inputs (reuse across layers; see regions.py).
    - ``min_fusible``: regions with fewer ops Inductor could generate code for run eagerly.
    - ``check_inputs``: also check every region input's shape/stride/dtype at run time (debug;
      the graph's own inputs are always checked with regions).
    - ``device``: where slot/host buffers live (default: the device of the graph's values).
    - ``fold_stores``: the ``store_grad`` nodes into device slots (``folds_into_region``) do not
      cut the graph into regions: ``backend="eager"`` regions run them themselves, in graph order;
      compiled regions leave them to the executor, which runs them right after the region
      (``_by_regions``). Each region lists them in ``effects``; ``around_region`` is where the
      caller does their bookkeeping.
    """

    def __init__(self, gm: fx.GraphModule, *, split: str = "regions", backend: str = "inductor",
                 cache: RegionCache | None = None, lift_params: bool = True, min_fusible: int = 2,
                 check_inputs: bool = False, device: torch.device | str | None = None,
                 fold_stores: bool = False):
        if split not in ("nodes", "regions"):
            raise ValueError(f"split={split!r}: expected 'nodes' or 'regions'")
        if fold_stores and split != "regions":
            raise ValueError("fold_stores=True needs split='regions' (node by node, every store is a step "
                             "of its own)")
        if backend not in tuple(Backend):
            raise ValueError(f"backend={backend!r}: expected one of {tuple(b.value for b in Backend)}")
        self.gm = gm
        self.split = split
        self.backend = backend if split == "regions" else "eager"
        self.cache = cache if cache is not None else RegionCache()
        self.check_inputs = check_inputs
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(nodes) if n.op == "output")
        if split == "nodes":
            program, self.regions, self.report, self._input_checks = _per_node(gm), [], None, ()
        else:
            program, self.regions, self.report, self._input_checks = _by_regions(
                gm, backend=backend, cache=self.cache, lift_params=lift_params, min_fusible=min_fusible,
                device=device, fold=fold_stores)
        _release_plan(program, self.output_node)
        self._program = program
        first_bwd = _first_backward(nodes)
        self._first_bwd_step = next(
            (i for i, s in enumerate(program)
             if (s.kind is StepKind.REGION and first_bwd in s.region.nodes) or s.node is first_bwd), None)

    # ------------------------------------------------------------------ running
    def run(self, inputs: Sequence[torch.Tensor], run_memory: Callable[[fx.Node, tuple], Any], *,
            on_outputs: Callable[[Sequence[Any]], None] | None = None, observer: NodeObserver | None = None,
            on_backward: Callable[[], None] | None = None,
            around_region: Callable[[Region], ContextManager] | None = None,
            call_region: Callable[[Region, bool, list], Sequence[Any]] | None = None) -> tuple:
        """Run the graph. ``on_outputs(values)`` sees each region's outputs and each evaluated
        node's value as they appear (storages allocated inside compiled code bypass Python dispatch); ``observer`` sees every node of
        ``split="nodes"``; ``on_backward()`` is called once, when the first backward step starts;
        ``around_region(region)`` is a context entered around each region's call;
        ``call_region(region, compiled, args)``, if given, calls each region instead of
        ``region.fn(args)`` (``compiled``: the region's ``fn`` is compiled code; ``probe.Probe``)."""
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"executor: {len(inputs)} inputs for {len(self.placeholders)} placeholders")
        for i, name, shape, stride, dtype in self._input_checks:
            t = inputs[i]
            if t.shape != shape or t.stride() != stride or t.dtype != dtype:
                raise ValueError(f"executor: input {i} ({name}) is {tuple(t.shape)} {t.stride()} "
                                 f"{t.dtype}, the graph was lowered for {shape} {stride} {dtype}")
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        check = self.check_inputs
        first_bwd = self._first_bwd_step if on_backward is not None else None
        for k, s in enumerate(self._program):
            # no local variable may keep a value alive past its last use: ``args`` is a list the
            # region clears, and ``outs`` / ``args`` are dropped right after use
            if k == first_bwd:
                on_backward()
            kind = s.kind
            if kind is StepKind.REGION:
                r = s.region
                args = [env[a] for a in r.inputs]
                if check:
                    check_region_args(r, args)
                held = dict(zip(r.held, map(env.__getitem__, r.held))) if r.deferred else None
                for a in s.free:                    # the region holds the only reference now
                    del env[a]
                fn = r.fn if call_region is None else (
                    lambda a, r=r: call_region(r, self.is_compiled(r), a))
                if around_region is not None:
                    with around_region(r):
                        outs = fn(args)
                else:
                    outs = fn(args)
                del fn
                del args
                if on_outputs is not None:
                    on_outputs(outs)
                env.update(zip(r.outputs, outs))     # (a loop variable would keep the last one alive)
                del outs
                if held is not None:
                    _run_deferred(r, env, held)
                    del held
                for o in s.dead:
                    del env[o]
                continue
            n = s.node
            if kind is StepKind.MEM:
                if observer is not None:
                    observer.before(n)
                made = run_memory(n, fx.node.map_arg(n.args, env.__getitem__))
                if n.users:                       # an activation's offload or reload
                    env[n] = made
                del made
                if observer is not None:
                    observer.after(n)
            elif kind is StepKind.EVAL:
                if observer is not None:
                    observer.before(n)
                if n.op == "get_attr":            # a constant the capture kept as an attribute
                    env[n] = _attr(self.gm, n.target)
                else:
                    env[n] = n.target(*fx.node.map_arg(n.args, env.__getitem__),
                                      **fx.node.map_arg(n.kwargs, env.__getitem__))
                    if on_outputs is not None and s.allocates:   # (a gathered parameter, not a view)
                        on_outputs((env[n],))
                if observer is not None:
                    observer.after(n)
            elif observer is not None:         # StepKind.INPUT: already in env
                observer.before(n)
                observer.after(n)
            for a in s.free:
                del env[a]
            for o in s.dead:
                del env[o]
        out = fx.node.map_arg(self.output_node.args[0], env.__getitem__)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def compiled_regions(self) -> list[Region]:
        """The regions run through the backend; the others run as eager graph code."""
        return [r for r in self.regions if self.is_compiled(r)]

    def is_compiled(self, r: Region) -> bool:
        """Region ``r`` runs compiled code (not eager graph code)."""
        return r.compute and self.backend != Backend.EAGER and r.fallback is None

    def fall_back(self, key: str, reason: str) -> list[Region]:
        """Regions of structural key ``key`` run as eager graph code from now on; returns them."""
        changed = [r for r in self.compiled_regions() if r.key == key]
        for r in changed:
            r.fallback, r.fn = reason, r.eager()
        return changed

    def describe(self) -> str:
        """One line per step: region sizes and keys, memory nodes, evaluated nodes."""
        lines = []
        for s in self._program:
            if s.kind is StepKind.REGION:
                r = s.region
                how = "eager" if (self.backend == Backend.EAGER or not r.compute) else \
                    "fallback" if r.fallback is not None else self.backend
                lines.append(f"region {r.index:3d} {len(r.nodes):4d} nodes  in {len(r.inputs):2d} out "
                             f"{len(r.outputs):2d}  {how:8s} {r.key[:10]}"
                             + (f"  then {len(r.deferred)} stores into slots" if r.deferred else ""))
            elif s.kind is StepKind.MEM:
                mem = mem_op(s.node)
                lines.append(f"  mem  {mem.describe() if mem is not None else s.node.format_node()}")
            elif s.kind is StepKind.EVAL:
                lines.append(f"  eval {s.node.format_node()}")
        return "\n".join(lines)


def lower_regions(gm: fx.GraphModule, *, backend: str = "inductor", cache: RegionCache | None = None,
                  lift_params: bool = True, min_fusible: int = 2) -> Executor:
    """Split ``gm`` at its memory nodes and compile each distinct compute region once."""
    return Executor(gm, split="regions", backend=backend, cache=cache, lift_params=lift_params,
                    min_fusible=min_fusible)
