"""The executor: runs a scheduled graph, memory nodes exactly as planned, compute in between.

One executor serves every way compiled mode runs a schedule. It turns the scheduled graph into a
*program* of steps and runs them in order, releasing every value after its last use:

    split="nodes"     every compute node is one step, run eagerly: a schedule's measuring run
                      (its first), which measures each node's non-model bytes through an
                      observer;
    split="regions"   the graph is cut at its memory nodes into compute regions
                      (``regions.py``), each run as eager graph code (compiled eager: the
                      ``backend="eager"`` engine, and the fallback of ``compiled/lowering.py``).

A schedule compiled by Inductor as one program runs in ``compiled/whole.py`` instead.

In both, a memory node is never run as an op: the executor calls ``run_memory(node, args)`` with
its evaluated arguments, and the engine performs the copy on its transfer queue and counts it.
Activation nodes (``offload`` / ``reload``) run the same way; what ``run_memory`` returns for them
is their value.
``run`` has the semantics of ``gm(*inputs)`` otherwise: it returns the graph's outputs.

The program (its steps, how regions are cut, described and compiled, when values are released)
is built in ``compiled/steps.py``; this module runs it.

Memory: ``split="nodes"`` frees exactly as ``fx.Interpreter(garbage_collect_values=True)`` does,
and a value nobody reads dies as soon as it is made, which is what ``estimate_nonmodel`` assumes.
Regions receive their inputs boxed (the list is cleared) so an input dies inside the region.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch import fx

from pscompile.compiled.steps import (LoweringReport, Step, StepKind, attr, by_regions, first_backward,
                                        is_compute_op, per_node, release_plan)
from pscompile.compiled.listing import profiler_node_name, profiler_region_name
from pscompile.compiled.regions import Region
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import mem_op
from pscompile import profiling
from pscompile.profiling import NOTHING as _NOTHING

__all__ = ["Executor", "LoweringReport", "NodeObserver", "Step", "StepKind"]


def _slot_view(a: fx.Node) -> bool:
    """A parameter the executor makes as a view of its slot (not a gathered copy): freeing it frees
    no memory."""
    base = a.args[0] if a.args else None
    return gmeta.get(a, "param") is not None and not (isinstance(base, fx.Node) and gmeta.get(base, "gather"))


class NodeObserver(Protocol):
    """Sees every step of ``split="nodes"``: ``before(node)`` right before it runs, ``after(node)``
    once its value exists and before the values it read last are released."""

    def before(self, node: fx.Node) -> None: ...

    def after(self, node: fx.Node) -> None: ...


class Executor:
    """Runs one scheduled graph (see the module doc).

    - ``split``: "nodes" (each compute node a step) or "regions" (eager compute regions).
    - ``fold_stores``: the ``store_grad`` nodes into device slots (``folds_into_region``) do not
      cut the graph into regions: the regions run them themselves, in graph order. Each region
      lists them in ``effects``; ``around_region`` is where the caller does their bookkeeping.
    """

    def __init__(self, gm: fx.GraphModule, *, split: str = "regions", fold_stores: bool = False):
        if split not in ("nodes", "regions"):
            raise ValueError(f"split={split!r}: expected 'nodes' or 'regions'")
        self._range_names: dict = {}       # region index or memory node -> its profiler range's name
        if fold_stores and split != "regions":
            raise ValueError("fold_stores=True needs split='regions' (node by node, every store is a step "
                             "of its own)")
        self.gm = gm
        self.split = split
        # regions: what each allocates beyond what is live at its start (region index -> bytes),
        # learned by the engine's tracker, operator by operator, in the executor's first run (``learn``)
        self.region_extra: dict[int, int] = {}
        self.learned = split != "regions"
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(nodes) if n.op == "output")
        if split == "nodes":
            program, self.regions, self.report = per_node(gm), [], None
        else:
            program, self.regions, self.report = by_regions(gm, fold=fold_stores)
        release_plan(program, self.output_node)
        for s in program:     # inputs whose memory dies in the region: the environment lets go of them before
            if s.kind is StepKind.REGION:      # the call, and they are no view of a slot (model memory)
                free = set(s.free)
                s.region.frees = frozenset(i for i, a in enumerate(s.region.inputs) if a in free
                                           and a.op != "get_attr" and not _slot_view(a))
        self._program = program
        # compute operators a run runs (outside regions: evaluated nodes)
        self.ops = sum(s.region.ops if s.kind is StepKind.REGION else int(s.kind is StepKind.EVAL and is_compute_op(s.node))
                       for s in program)
        self._views: dict[fx.Node, tuple[list, Any]] = {}   # memo steps: (arguments, the view made of them)
        first_bwd = first_backward(nodes)
        self._first_bwd_step = next(
            (i for i, s in enumerate(program)
             if (s.kind is StepKind.REGION and first_bwd in s.region.nodes) or s.node is first_bwd), None)

    def learn(self, extra: dict[int, int]) -> None:
        """What the regions allocate inside, measured in this executor's first run (a failed run
        learns nothing: the next measures again)."""
        self.region_extra.update(extra)
        self.learned = True

    # ------------------------------------------------------------------ running
    def run(self, inputs: Sequence[torch.Tensor], run_memory: Callable[[fx.Node, tuple], Any], *,
            on_outputs: Callable[[Sequence[Any]], None] | None = None, observer: NodeObserver | None = None,
            on_backward: Callable[[], None] | None = None,
            around_region: Callable[[Region], ContextManager] | None = None) -> tuple:
        """Run the graph. ``on_outputs(values)`` sees each region's outputs and each evaluated
        node's value as they appear; ``observer`` sees every node of ``split="nodes"``;
        ``on_backward()`` is called once, when the first backward step starts;
        ``around_region(region)`` is a context entered around each region's call.

        Long on purpose: the executor's hot loop, inlined (a call per step costs on every step of every
        run).
        """
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"executor: {len(inputs)} inputs for {len(self.placeholders)} placeholders")
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        ranges = self._ranges() if profiling.recording() else None    # named ranges for the profiler
        memo = self._views
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
                for a in s.free:                    # the region holds the only reference now
                    del env[a]
                fn = r.fn
                if ranges is not None:
                    with ranges(r), around_region(r) if around_region is not None else _NOTHING:
                        outs = fn(args)
                elif around_region is not None:
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
                for o in s.dead:
                    del env[o]
                continue
            n = s.node
            if kind is StepKind.MEM:
                if observer is not None:
                    observer.before(n)
                if ranges is not None:
                    with ranges(n):
                        made = run_memory(n, fx.node.map_arg(n.args, env.__getitem__))
                else:
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
                    env[n] = attr(self.gm, n.target)
                elif s.memo:                       # a view of a slot (program.Step.memo)
                    args = [env[a] if isinstance(a, fx.Node) else a for a in n.args]   # (constants: the same objects)
                    kept = memo.get(n)
                    if kept is None or any(x is not y for x, y in zip(kept[0], args)):
                        memo[n] = kept = (args, n.target(*args))
                    env[n] = kept[1]
                    del args, kept
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

    def _ranges(self) -> Callable[[Region | fx.Node], ContextManager]:
        """The profiler range of each region and memory node (``pscompile/profiling.py``), named once."""
        names = self._range_names
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

        def ranges(x: Region | fx.Node) -> ContextManager:
            key = ("region", x.index) if isinstance(x, Region) else x
            name = names.get(key)
            if name is None:
                name = names[key] = profiler_region_name(x.index, x.nodes, x.effects) if isinstance(x, Region) \
                    else profiler_node_name(x)
            return profiling.named(name, cuda)
        return ranges

    def describe(self) -> str:
        """One line per step: region sizes and keys, memory nodes, evaluated nodes."""
        lines = []
        for s in self._program:
            if s.kind is StepKind.REGION:
                r = s.region
                lines.append(f"region {r.index:3d} {len(r.nodes):4d} nodes  in {len(r.inputs):2d} out "
                             f"{len(r.outputs):2d}  eager" + (f"  with {len(r.effects)} stores into slots"
                                                             if r.effects else ""))
            elif s.kind is StepKind.MEM:
                mem = mem_op(s.node)
                lines.append(f"  mem  {mem.describe() if mem is not None else s.node.format_node()}")
            elif s.kind is StepKind.EVAL:
                lines.append(f"  eval {s.node.format_node()}")
        return "\n".join(lines)
