"""recompute_activations: forward values the backward reads, recomputed in the backward instead of kept.

In the captured joint graph (``capture.capture_joint``) a "saved activation" is simply a forward
node with a backward user: it stays live from the forward to that use, and at the end of the
forward all of them are live together, which is where the non-model curve peaks. This pass
rewrites the graph so that chosen saved values die in the forward and are computed again, from a
value that is kept, right before the backward first needs them (what ``torch.utils.checkpoint``
does at run time, done here on the graph).

**Segments.** A *cut* is a forward node through which all later forward computation passes: after
it runs, no earlier forward value is still needed by a later forward node except the cut itself
(and values that are never recomputed, below). In a transformer the cuts are the residual stream
after each attention and each MLP sub-block. A *segment* is the forward between two cuts; its
*saved* values are those the backward reads. Recomputing a segment clones the nodes its saved
values depend on, starting from the cut before it (kept), and redirects the backward's uses to
the clones. Parameters read by the clones are read again: the residency plan sees those reads,
because it plans the rewritten graph.

**Never recomputed, always kept** (*anchors*): random ops (``Tag.nondeterministic_seeded``, e.g.
dropout's ``bernoulli``), so that a recomputed value sees the same random numbers as the forward;
ops that mutate an argument; values whose storage a forward op mutates; anything that is not an
ATen op; a value that is not a tensor (a range's ``sym_size``: read all through the forward, as a
tensor it would leave no cut, and it costs no memory). *Free* values, which depend on parameters, buffers or constants only (``t(weight)``, a
causal mask), are referenced where they are, not cloned.

**Dropout masks** the backward reads are kept as one byte per element: ``ne(mask, 0)`` in the
forward, the scaled mask rebuilt from it by the same division right before the backward needs it.

The result equals the graph it came from: the same ops on the same values, random numbers drawn
once, in the same order. Clones carry ``recomputes`` metadata (the node they recompute), which
``print(engine.schedule)`` shows.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from pscompile.graph import meta as graph_meta
from pscompile.graph.capture import CapturedGraph
from pscompile.passes.annotate_params import tensor_storages
from pscompile.units import format_bytes

log = logging.getLogger("pscompile")


@dataclass(frozen=True)
class Segment:
    """The forward between two cuts, and what recomputing it buys."""

    index: int
    source: str | None          # the cut it is recomputed from (kept); None: from the inputs
    end: str                    # the cut that ends it
    saved: tuple[str, ...]      # its values the backward reads: recomputed when the segment is
    saved_bytes: int            # their storages' bytes (what stops being live across the boundary)
    nodes: int                  # nodes cloned to recompute them
    flops: int = 0              # floating-point operations of those nodes (matmuls, convolutions, attention)


@dataclass(frozen=True)
class ActivationPlan:
    """What a graph keeps, recomputes and offloads; ``recomputed`` and ``offloaded`` index ``segments``."""

    policy: str                       # the Config.activations that chose it
    segments: tuple[Segment, ...]
    recomputed: tuple[int, ...] = ()
    offloaded: tuple[int, ...] = ()   # segments whose saved storages wait on the host (offload_activations)
    offload_bytes: int = 0            # the bytes of those storages (each crosses the link twice)
    overlapped: bool = False          # their copies run asynchronously, one ahead (offload_activations)

    @property
    def recomputed_bytes(self) -> int:
        return sum(self.segments[i].saved_bytes for i in self.recomputed)

    @property
    def recomputed_nodes(self) -> int:
        return sum(self.segments[i].nodes for i in self.recomputed)

    def describe(self) -> str:
        if not self.recomputed and not self.offloaded:
            return (f"activations {self.policy}: every saved activation kept ({len(self.segments)} segments could "
                    f"recompute or offload)")
        parts = []
        if self.recomputed:
            parts.append(f"{len(self.recomputed)} of {len(self.segments)} segments recomputed "
                         f"({format_bytes(self.recomputed_bytes)} of saved activations, {self.recomputed_nodes} "
                         f"nodes re-run)")
        if self.offloaded:
            parts.append(f"{len(self.offloaded)} of {len(self.segments)} segments offloaded "
                         f"({format_bytes(self.offload_bytes)} of saved activations wait on the host, copies "
                         f"{'overlapped with compute' if self.overlapped else 'waited for'})")
        return f"activations {self.policy}: " + "; ".join(parts)


def _is_random(n: fx.Node) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _has_tensor(n: fx.Node) -> bool:
    """Whether ``n``'s value is or holds a tensor (not a size: ``sym_size`` of a range's batch)."""
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v))


def _nbytes(value) -> dict[StorageWeakRef, int]:
    if isinstance(value, torch.Tensor):
        return {StorageWeakRef(value.untyped_storage()): value.untyped_storage().nbytes()}
    out: dict[StorageWeakRef, int] = {}
    if isinstance(value, (tuple, list)):
        for v in value:
            out.update(_nbytes(v))
    return out


class _Forward:
    """The forward of a captured joint graph, classified (see the module docstring)."""

    def __init__(self, captured: CapturedGraph):
        nodes = list(captured.gm.graph.nodes)
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}
        out = nodes[-1]
        self.loss = out.args[0][0]
        self.end = self.index[self.loss]          # forward: nodes up to the loss
        placeholders = [n for n in nodes if n.op == "placeholder"]
        n_model = len(captured.param_fqns) + len(captured.buffer_fqns)
        self.batch = set(placeholders[n_model:])
        fwd = [n for n in nodes[:self.end + 1] if n.op not in ("placeholder", "get_attr")]
        mutated: set[StorageWeakRef] = set()
        for n in fwd:
            if _mutates(n):
                for a in n.all_input_nodes:
                    mutated.update(tensor_storages(a.meta.get("val")))
        self.anchor: set[fx.Node] = set()
        self.active: set[fx.Node] = set()          # depends on the batch (or on an anchor)
        for n in fwd:
            if (n.op != "call_function" or _is_random(n) or _mutates(n) or not _has_tensor(n)
                    or not (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem)
                    or any(s in mutated for s in tensor_storages(n.meta.get("val")))):
                self.anchor.add(n)
            if any(a in self.batch or a in self.active or a in self.anchor for a in n.all_input_nodes):
                self.active.add(n)
        self.fwd = fwd
        # recomputable activations: the values segments are made of
        self.movable = [n for n in fwd if n in self.active and n not in self.anchor]

    def backward_users(self, n: fx.Node) -> list[fx.Node]:
        """Users after the loss (nodes added since, the clones, are all in the backward)."""
        return [u for u in n.users if self.index.get(u, len(self.nodes)) > self.end and u.op != "output"]

    def is_free(self, n: fx.Node) -> bool:
        return n.op in ("placeholder", "get_attr") or (n not in self.active and n not in self.anchor)


def find_segments(captured: CapturedGraph) -> tuple[Segment, ...]:
    """The segments of ``captured``'s forward that have saved values, in forward order."""
    if not captured.backward:
        return ()
    f = _Forward(captured)
    cuts = forward_cuts(f)
    kept_bytes = kept_storages(f, cuts)
    segments: list[Segment] = []
    start = 0
    bounds = [f.index[c] for c in cuts]
    for k, c in enumerate(cuts):
        lo, hi = start, bounds[k]
        inner = [n for n in f.movable if lo < f.index[n] < hi or (k == 0 and f.index[n] < hi)]
        saved = [n for n in inner if f.backward_users(n)]
        start = hi
        if not saved:
            continue
        sizes: dict[StorageWeakRef, int] = {}
        for n in saved:
            sizes.update(_nbytes(n.meta.get("val")))
        nbytes = sum(b for s, b in sizes.items() if s not in kept_bytes)
        if nbytes == 0:
            continue
        source = cuts[k - 1] if k > 0 else None
        need = _needed(f, saved, source)
        segments.append(Segment(len(segments), source.name if source is not None else None, c.name,
                                tuple(n.name for n in saved), nbytes, len(need), sum(map(_flops, need))))
    return tuple(segments)


def _flops(n: fx.Node) -> int:
    """The floating-point operations of one node: ``torch.utils.flop_counter``'s formulas for
    matmuls, convolutions and attention, one per output element for anything else."""
    from torch.utils.flop_counter import flop_registry
    fn = flop_registry.get(getattr(n.target, "overloadpacket", None))
    if fn is None:
        v = n.meta.get("val")
        return sum(t.numel() for t in (v if isinstance(v, (tuple, list)) else (v,)) if isinstance(t, torch.Tensor))
    val = lambda a: a.meta["val"]      # noqa: E731
    return int(fn(*fx.map_arg(n.args, val), **fx.map_arg(n.kwargs, val), out_val=n.meta["val"]))


def forward_cuts(f: _Forward) -> list[fx.Node]:
    """The cuts of the forward, in order (see the module docstring)."""
    movable = set(f.movable)
    last_fwd_use = {n: max((f.index[u] for u in n.users if f.index[u] <= f.end), default=f.index[n])
                    for n in f.movable}
    cuts: list[fx.Node] = []
    pending: set[fx.Node] = set()
    for n in f.fwd:
        if n not in movable:
            continue
        i = f.index[n]
        pending.add(n)
        pending = {p for p in pending if last_fwd_use[p] > i or p is n}
        if pending == {n}:
            cuts.append(n)
    return cuts


def kept_storages(f: _Forward, cuts: Sequence[fx.Node]) -> set[StorageWeakRef]:
    """Storages that stay on the device whatever is recomputed: those of the cuts and anchors."""
    return {s for k in set(cuts) | f.anchor for s in tensor_storages(k.meta.get("val"))}


def _needed(f: _Forward, saved: Sequence[fx.Node], source: fx.Node | None) -> list[fx.Node]:
    """The forward nodes to clone to rebuild ``saved`` from ``source``, in graph order."""
    need: set[fx.Node] = set()
    stack = list(saved)
    while stack:
        n = stack.pop()
        if n in need or n is source or n in f.anchor or f.is_free(n) or n in f.batch:
            continue
        need.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(need, key=f.index.__getitem__)


def recompute_activations(captured: CapturedGraph, segments: Iterable[Segment]) -> CapturedGraph:
    """A copy of ``captured`` in which the saved values of ``segments`` are recomputed in the
    backward (the input is not changed; its analyses stay valid)."""
    chosen = list(segments)
    gm = _copy(captured.gm)
    if not chosen:
        return replace(captured, gm=gm)
    copy = replace(captured, gm=gm)
    f = _Forward(copy)
    by_name = {n.name: n for n in f.nodes}
    mode = _fake_mode(f.nodes)
    graph = gm.graph
    for seg in chosen:
        saved = [by_name[s] for s in seg.saved]
        source = by_name[seg.source] if seg.source is not None else None
        need = _needed(f, saved, source)
        first = min((u for s in saved for u in f.backward_users(s)), key=f.index.__getitem__)
        clones: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(first):
            for n in need:
                c = graph.node_copy(n, lambda a: clones.get(a, a))
                c.meta = {k: v for k, v in n.meta.items() if k not in (graph_meta.KEY, "val")}
                graph_meta.put(c, "recomputes", n.name)
                with mode:
                    c.meta["val"] = c.target(*fx.map_arg(c.args, lambda a: a.meta["val"]),
                                             **fx.map_arg(c.kwargs, lambda a: a.meta["val"]))
                clones[n] = c
        for s in saved:
            for u in f.backward_users(s):
                u.replace_input_with(s, clones[s])
    _compress_masks(f, graph, mode)
    for n in reversed(list(graph.nodes)):       # the forward's element of a multi-output op (layer
        if n.target is operator.getitem and not n.users:   # norm's saved mean) that only the backward read
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    log.info(f"recompute_activations: {len(chosen)} segments, "
             f"{format_bytes(sum(s.saved_bytes for s in chosen))} of saved activations recomputed")
    return copy


def _compress_masks(f: _Forward, graph: fx.Graph, mode) -> int:
    """Dropout masks the backward reads, kept as one byte per element: a mask made by a random
    ``bernoulli`` divided in place by the keep probability (values 0 and 1/keep) is kept as
    ``ne(mask, 0)`` (bool) and rebuilt right before the backward's first use by the same division
    of its 0/1 values, so the rebuilt mask is bit-identical. Returns how many were compressed."""
    aten = torch.ops.aten
    done = 0
    for d in f.fwd:
        if d.target is not aten.div_.Scalar or not isinstance(d.args[0], fx.Node) or not _is_random(d.args[0]):
            continue
        users = f.backward_users(d)
        if not users:
            continue
        dtype = d.meta["val"].dtype
        with graph.inserting_after(d):
            flag = graph.call_function(aten.ne.Scalar, (d, 0))
        first = min(users, key=lambda u: _position(graph, u))
        with graph.inserting_before(first):
            ones = graph.call_function(aten._to_copy.default, (flag,), {"dtype": dtype})
            mask = graph.call_function(aten.div.Scalar, (ones, d.args[1]))
        for new in (flag, ones, mask):
            with mode:
                new.meta["val"] = new.target(*fx.map_arg(new.args, lambda a: a.meta["val"]),
                                             **fx.map_arg(new.kwargs, lambda a: a.meta["val"]))
            graph_meta.put(new, "mask_of", d.name)
        for u in users:
            u.replace_input_with(d, mask)
        done += 1
    return done


def _position(graph: fx.Graph, node: fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def _fake_mode(nodes: Sequence[fx.Node]):
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is not None:
            return v.fake_mode
    raise ValueError("recompute_activations needs the captured graph's fake tensor values (meta['val'])")


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy of ``gm`` (same node names and values, fresh pscompile metadata)."""
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map)
    graph.output(out)
    graph.output_node().meta = dict(gm.graph.output_node().meta)
    for old, new in val_map.items():
        new.meta = {k: v for k, v in old.meta.items() if k != graph_meta.KEY}
    graph._codegen = gm.graph._codegen
    new_gm = graph_meta.graph_module(gm, graph)
    return new_gm
