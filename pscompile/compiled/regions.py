"""Compute regions: a scheduled graph cut at its memory nodes, as eager code (compiled eager).

The scheduled graph (``insert_memory_ops``) interleaves compute nodes with memory nodes
(``torch.ops.pscompile.*``). Compiled eager, the fallback of ``compiled/lowering.py``, cuts it at
every memory node into maximal *compute regions*; each region becomes a small graph run as the
Python code FX generates for it::

    region 0    arange, embedding(view(slice(slot_0))), ...          eager graph code
    mem         pscompile.fetch(slot_1, host_1)                       run by the executor
    region 1    native_layer_norm(add, [64], p_0, p_1), getitems, ...  eager graph code
    mem         pscompile.store_grad(slot_1, t_7, 512)                 t_7 is an output of region 1

Rules of the split (``program.by_regions``):

- a multi-output op and its ``getitem`` nodes stay in one region;
- only real tensors cross region boundaries; a *view of a slot or host buffer* never does: a
  region that needs one made elsewhere re-creates the view chain, so no region keeps a parameter
  alive past a memory node;
- a region returns what later steps need (values read by later regions, by memory nodes, or the
  graph's outputs); inputs are passed with the *boxed* calling convention (the list is cleared),
  so an input dies inside the region at its last use;
- gradient stores into device slots fold into the region that makes the gradient (``effects``).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from pscompile.graph import meta as gmeta
from pscompile.graph.ops import is_memory_node

__all__ = ["Region", "buffer_placeholders", "buffer_aliases", "eager_fn", "eval_chain", "is_view_op"]

aten = torch.ops.aten


# ====================================================================== node classes
def is_view_op(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view


def buffer_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
    """Slot and host buffers: placeholders tagged by insert_memory_ops or read by memory nodes."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and (gmeta.get(n, "slot") is not None or gmeta.get(n, "host_chunk") is not None):
            out.add(n)
        elif is_memory_node(n):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    out.add(a)
    return out


def buffer_aliases(gm: fx.GraphModule, buffers: set[fx.Node]) -> set[fx.Node]:
    """Nodes whose value is a view of a slot/host buffer (views of views included)."""
    alias = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_memory_node(n) or not n.args:
            continue
        src = n.args[0]
        if isinstance(src, fx.Node) and (src in buffers or src in alias) and (
                is_view_op(n) or n.target is operator.getitem):
            alias.add(n)
    return alias


# ====================================================================== regions
@dataclass
class Region:
    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    graph: fx.Graph | None = None
    fn: Callable[[list], Sequence[Any]] | None = None
    effects: list[fx.Node] = field(default_factory=list)   # stores into device slots this region's step runs
    ops: int = 0                    # its compute operators (is_compute_op)
    frees: frozenset[int] = frozenset()     # positions of the inputs it is the last reader of
    _eager: Callable[[list], Sequence[Any]] | None = field(default=None, repr=False)

    def eager(self) -> Callable[[list], Sequence[Any]]:
        """The region's graph as eager code (boxed, like ``fn``), made on first use."""
        if self._eager is None:
            self._eager = eager_fn(self.graph)
        return self._eager


def eager_fn(graph: fx.Graph) -> Callable[[list], Sequence[Any]]:
    g = copy.deepcopy(graph)
    try:
        from torch.fx.graph import _BoxedCodeGen
        g.set_codegen(_BoxedCodeGen())
        gm = fx.GraphModule({}, g)
        return gm.forward
    except ImportError:                           # pragma: no cover - older torch
        gm = fx.GraphModule({}, g)

        def call(args: list):
            a = list(args)
            args.clear()
            return gm(*a)
        return call


def eval_chain(a: fx.Node, allowed: set[fx.Node]) -> list[fx.Node]:
    """``a`` and the nodes it is computed from inside ``allowed``, in evaluation order."""
    out: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(x: fx.Node) -> None:
        if x in seen or x not in allowed:
            return
        seen.add(x)
        for y in x.all_input_nodes:
            visit(y)
        out.append(x)
    visit(a)
    return out
