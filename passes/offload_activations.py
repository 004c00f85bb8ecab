"""offload_activations: saved activations that wait on the host between their forward and backward uses.

The other way to take a saved activation off the device (``recompute_activations`` is the first):
its storage is copied to the host right after its last forward use and copied back right before
its first backward use, so between the two it costs host memory and link traffic instead of
device memory. The pass rewrites the captured joint graph with two activation nodes per storage::

    h = pscompile.offload(root)            after the last forward node that reads the storage
    r = pscompile.reload(h, device)        before the first backward node that reads it
    v' = <view ops of v, from r>           the saved views of the storage, made again from r

and the backward reads ``r`` (or the re-made views) instead of the forward's values, so the
forward's copy dies at the offload (the executor frees a value after its last reader).

**What is offloaded.** The unit is a *storage*, not a value: views share their base's memory, so
offloading one view would free nothing and reloading two views of one storage would bring it back
twice. A storage is offloadable when

- it belongs to a segment's saved values (``recompute_activations.find_segments``) and is not kept
  anyway (not the storage of a cut or of an anchor: random ops, mutated storages, non-ATen ops);
- its *root*, the first forward node holding it, is a computed value that covers the whole
  storage (offset 0, every byte), so one copy carries all of it;
- every other forward node holding it that the backward reads is a chain of view ops from the root
  (those chains are cloned after the reload; views cost nothing).

The result computes exactly what the graph it came from computes: the backward reads bit-identical
copies of the values it read before. ``estimate_nonmodel`` counts the host copy as no device memory,
and the residency plan sees the reloaded value's bytes from the reload on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from pscompile.graph import meta as graph_meta
from pscompile.graph.capture import CapturedGraph
from pscompile.graph.ops import ActivationMove, activation_move
from pscompile.kinds import MemKind
from pscompile.passes.annotate_params import tensor_storages
from pscompile.passes.recompute_activations import (Segment, _copy, _fake_mode, _Forward, forward_cuts,
                                                    kept_storages)
from pscompile.units import format_bytes

log = logging.getLogger("pscompile")

__all__ = ["Offload", "find_offloads", "offload_activations"]


@dataclass(frozen=True)
class Offload:
    """One storage that can wait on the host: its root value, the saved views made from it, its bytes."""

    root: str                   # the forward node that created the storage (offloaded whole)
    views: tuple[str, ...]      # other saved nodes of the storage, re-made from the reloaded root
    nbytes: int
    segment: int                # the segment (``Segment.index``) whose saved values it holds


def _is_view(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view \
        and bool(n.args) and isinstance(n.args[0], fx.Node)


def _covers_storage(v) -> bool:
    if not isinstance(v, torch.Tensor) or v.storage_offset() != 0:
        return False
    extent = 1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride())) if v.numel() else 0
    nbytes = v.untyped_storage().nbytes()
    return nbytes > 0 and extent * v.element_size() == nbytes == v.numel() * v.element_size()


def find_offloads(captured: CapturedGraph, segments: Sequence[Segment]) -> dict[int, tuple[Offload, ...]]:
    """Per segment index, the storages of its saved values that ``offload_activations`` can move."""
    if not segments:
        return {}
    f = _Forward(captured)
    kept = kept_storages(f, forward_cuts(f))
    by_name = {n.name: n for n in f.nodes}
    holders = _holders(f)
    out: dict[int, tuple[Offload, ...]] = {}
    seen: set[StorageWeakRef] = set()
    for seg in segments:
        found = []
        for name in seg.saved:
            v = by_name[name].meta.get("val")
            if not isinstance(v, torch.Tensor):
                continue
            (st,) = tensor_storages(v)
            if st in kept or st in seen:
                continue
            seen.add(st)
            off = _offload_of(f, holders[st])
            if off is not None:
                found.append(replace(off, segment=seg.index))
        if found:
            out[seg.index] = tuple(found)
    return out


def _holders(f: _Forward) -> dict[StorageWeakRef, list[fx.Node]]:
    """Per storage, the forward nodes whose value is a tensor of it, in graph order."""
    holders: dict[StorageWeakRef, list[fx.Node]] = {}
    for n in f.nodes[:f.end + 1]:
        v = n.meta.get("val")
        if n.op != "output" and isinstance(v, torch.Tensor):
            for st in tensor_storages(v):
                holders.setdefault(st, []).append(n)
    return holders


def _offload_of(f: _Forward, holders: list[fx.Node]) -> Offload | None:
    root = holders[0]
    if root.op != "call_function" or root in f.anchor or not _covers_storage(root.meta["val"]):
        return None
    members = set(holders)
    views = []
    for h in holders[1:]:
        if not f.backward_users(h):
            continue
        n = h
        while n is not root:                   # a chain of views from the root, inside the storage
            if not _is_view(n) or n.args[0] not in members:
                return None
            n = n.args[0]
        views.append(h.name)
    if not f.backward_users(root) and not views:
        return None
    return Offload(root.name, tuple(views), root.meta["val"].untyped_storage().nbytes(), -1)


def offload_activations(captured: CapturedGraph, offloads: Iterable[Offload], *, overlap: bool = False) -> CapturedGraph:
    """A copy of ``captured`` in which each of ``offloads`` goes to the host after its last forward
    use and comes back before its first backward use (the input is not changed). ``overlap``: the
    copies run while compute goes on (``_overlap``)."""
    chosen = list(offloads)
    gm = _copy(captured.gm)
    copy = replace(captured, gm=gm)
    if not chosen:
        return copy
    f = _Forward(copy)
    by_name = {n.name: n for n in f.nodes}
    mode = _fake_mode(f.nodes)
    holders = _holders(f)
    graph = gm.graph
    offload_op, reload_op = torch.ops.pscompile.offload.default, torch.ops.pscompile.reload.default

    def fake(node: fx.Node) -> None:
        with mode:
            node.meta["val"] = node.target(*fx.map_arg(node.args, lambda a: a.meta["val"]),
                                           **fx.map_arg(node.kwargs, lambda a: a.meta["val"]))

    for o in chosen:
        root = by_name[o.root]
        views = [by_name[v] for v in o.views]
        chain: set[fx.Node] = set()
        for v in views:
            n = v
            while n is not root:
                chain.add(n)
                n = n.args[0]
        members = [root, *sorted(chain, key=f.index.__getitem__)]
        (st,) = tensor_storages(root.meta["val"])
        last_fwd = max((f.index[u] for m in holders[st] for u in m.users if f.index.get(u, len(f.nodes)) <= f.end),
                       default=f.index[root])
        bwd = {m: f.backward_users(m) for m in [root, *views]}     # before the offload becomes a user
        first = min((u for us in bwd.values() for u in us), key=f.index.__getitem__)
        with graph.inserting_after(f.nodes[max(last_fwd, f.index[root])]):
            host = graph.call_function(offload_op, (root,))
        fake(host)
        graph_meta.put(host, "moves", ActivationMove(MemKind.OFFLOAD, o.root, o.nbytes))
        with graph.inserting_before(first):
            back = graph.call_function(reload_op, (host, root.meta["val"].device))
            fake(back)
            graph_meta.put(back, "moves", ActivationMove(MemKind.RELOAD, o.root, o.nbytes))
            made = {root: back}
            for m in members[1:]:
                c = graph.node_copy(m, lambda a: made.get(a, a))
                c.meta = {k: v for k, v in m.meta.items() if k not in (graph_meta.KEY, "val")}
                fake(c)
                graph_meta.put(c, "reloads", o.root)
                made[m] = c
        for m, users in bwd.items():
            for u in users:
                u.replace_input_with(m, made[m])
    if overlap:
        _overlap(graph, f.loss)
    graph.lint()
    gm.recompile()
    log.info(f"offload_activations: {len(chosen)} storages, {format_bytes(sum(o.nbytes for o in chosen))} "
             f"of saved activations wait on the host")
    return copy


def _overlap(graph: fx.Graph, loss: fx.Node) -> None:
    """Make the copies asynchronous, one ahead, each with a ``wait_copy`` where it must have landed:

    - offload j waits right before offload j+1 is issued (the last one right after the loss), and
      its device value lives until then, so the forward goes on while it crosses the link;
    - reload j (j >= 1, in backward order: by first reader) is issued right before the wait of reload j-1 (right
      after reload 0, which stays where it is) and waited for right before its first reader, so it
      crosses the link while the backward of the previous one runs.

    Memory follows from the graph: an offloaded value lives until its wait, a reloaded one from its
    issue, which the non-model analysis counts like any other value."""
    wait_op = torch.ops.pscompile.wait_copy.default
    nodes = list(graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    outs = [n for n in nodes if n.target is torch.ops.pscompile.offload.default]
    first_read = {n: min(where[u] for u in n.users) for n in nodes if n.target is torch.ops.pscompile.reload.default}
    backs = sorted(first_read, key=lambda n: (first_read[n], where[n]))     # backward order: by first reader

    def wait(copy: fx.Node, source: fx.Node | None) -> fx.Node:
        node = graph.call_function(wait_op, (copy,) if source is None else (copy, source))
        node.meta["val"] = None
        move = activation_move(copy)
        graph_meta.put(node, "moves", ActivationMove(MemKind.WAIT, move.value, 0))
        graph_meta.put(copy, "moves", replace(move, asynchronous=True))
        return node

    for j, out in enumerate(outs):
        if j + 1 < len(outs):
            with graph.inserting_before(outs[j + 1]):
                wait(out, out.args[0])
        else:
            with graph.inserting_after(max(out, loss, key=where.__getitem__)):
                wait(out, out.args[0])
    previous_wait: fx.Node | None = None
    for j, back in enumerate(backs):
        if j == 0:
            continue                       # the first reload: read at once, nothing to overlap
        first_reader = nodes[first_read[back]]
        if previous_wait is None:
            backs[0].append(back)          # right after reload 0
        else:
            previous_wait.prepend(back)    # issued before the previous reload is waited for
        with graph.inserting_before(first_reader):
            previous_wait = wait(back, None)
