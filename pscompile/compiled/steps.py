"""The steps an executor runs (``compiled/executor.py``), built one per node or by regions between
memory nodes, and when each value is released. (Not a compiled program: that is ``whole.py``'s
``WholeProgram``, a schedule as one Inductor program.)

``per_node``: every node is a step. ``by_regions`` (compiled eager, the fallback rule of
``compiled/lowering.py``), in three phases over the scheduled graph: assign the nodes to steps (a
memory node cuts, a region runs between), build each region's own graph and wrap it as eager code,
and interleave the steps with the values the executor evaluates itself (buffer views) right
before their first reader. ``release_plan`` then marks each value's last reader.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import fx

from pscompile.compiled.regions import Region, buffer_aliases, buffer_placeholders, eval_chain, is_view_op
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import copy_grad_into, folds_into_region, is_memory_node, runs_as_transfer
from pscompile.kinds import Phase, StrEnum

aten = torch.ops.aten

__all__ = ["LoweringReport", "Step", "StepKind", "attr", "by_regions", "first_backward", "is_compute_op", "per_node",
           "release_plan"]


@dataclass(frozen=True)
class LoweringReport:
    regions: int            # compute regions (steps between memory nodes)
    memory_nodes: int
    rebuilt_views: int      # buffer views re-created in a later region (should be 0)
    moved_getitems: int     # getitems moved back into their op's region


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
            return r.inputs
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


def by_regions(gm: fx.GraphModule, *, fold: bool = False):
    """Regions between memory nodes, as eager graph code; buffer views as eval steps right before
    their first reader. ``fold``: memory nodes that ``folds_into_region`` (gradient stores into
    device slots) do not cut the graph; the region runs them itself, in graph order, and lists them
    in its ``effects``. Returns (program, regions, report)."""
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in reversed(nodes) if n.op == "output")
    buffers = buffer_placeholders(gm)
    aliases = buffer_aliases(gm, buffers)
    lifted = {n for n in nodes if n.op == "get_attr"}      # constants: evaluated by the executor, passed in
    cut = _assign(nodes, lifted, fold=fold)
    rebuilt = sum(_build_graph(r, cut.region_of, aliases, lifted) for r in cut.regions)
    # buffer views read by a memory node or the output: evaluated by the executor
    evals = {n for n in nodes if n in aliases and n not in lifted
             and any(u.op == "output" or is_memory_node(u) for u in n.users)}
    for r in cut.regions:
        r.fn = r.eager()
    program = _interleave(cut.steps, placeholders, lifted | evals | aliases, output_node)
    report = LoweringReport(regions=len(cut.regions), memory_nodes=cut.memory_nodes, rebuilt_views=rebuilt,
                            moved_getitems=cut.moved_getitems)
    return program, cut.regions, report


@dataclass
class _Cut:
    """The graph's nodes assigned to steps: regions between memory nodes."""

    steps: list[Step] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    region_of: dict[fx.Node, Region] = field(default_factory=dict)
    moved_getitems: int = 0
    memory_nodes: int = 0


def _assign(nodes: list[fx.Node], lifted: set[fx.Node], *, fold: bool) -> _Cut:
    """Assign every node to a step, in graph order (``by_regions``' docstring says what folds)."""
    cut = _Cut()
    cur: Region | None = None
    for n in nodes:
        if n.op in ("placeholder", "output") or n in lifted:
            continue                                     # (lifted: made by the executor when needed)
        folds = fold and runs_as_transfer(n) and folds_into_region(n)
        if runs_as_transfer(n) and not folds:
            cur = None
            cut.steps.append(Step(StepKind.MEM, node=n))
            cut.memory_nodes += 1
            continue
        if n.op != "call_function":
            raise ValueError(f"executor: node {n.name} ({n.op}) is not supported; "
                             "the scheduled graph should only call functions")
        item = n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in cut.region_of
        if item and cut.region_of[n.args[0]] is not cur:
            r = cut.region_of[n.args[0]]                 # keep a tuple op with its getitems
            r.nodes.append(n)
            cut.region_of[n] = r
            cut.moved_getitems += 1
            continue
        if cur is None:
            cur = Region(len(cut.regions))
            cut.regions.append(cur)
            cut.steps.append(Step(StepKind.REGION, region=cur))
        cur.nodes.append(n)
        cut.region_of[n] = cur
        if runs_as_transfer(n):
            cur.effects.append(n)
    return cut


def _build_graph(r: Region, region_of: dict[fx.Node, Region], aliases: set[fx.Node], lifted: set[fx.Node]) -> int:
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
    g.output(tuple(local[o] for o in outs))
    g.lint()
    r.graph = g
    r.ops = sum(1 for n in r.nodes if is_compute_op(n))
    return rebuilt


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
        ensure(s.region.inputs if s.kind is StepKind.REGION else s.node.all_input_nodes)
        program.append(s)
        if s.kind is StepKind.REGION:
            produced.update(s.region.outputs)
    ensure(output_node.all_input_nodes)
    return program


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
    spent: dict[int, list[fx.Node]] = {}     # made and last read by one step
    for a, i in last.items():
        if a not in keep:
            (spent if made.get(a) == i else frees).setdefault(i, []).append(a)
    for i, s in enumerate(program):
        s.free = tuple(frees.get(i, ()))
        s.dead = tuple(o for o in s.makes() if o not in last and o not in keep) + tuple(spent.get(i, ()))
