"""insert_memory_ops: rewrite the captured graph so every memory decision is an explicit node.

Parameter placeholders disappear. The graph takes the device slots and the host chunks as
placeholders instead; each node that reads a parameter reads a fresh view of the slot that holds
the parameter's chunk at that moment (view chains are rebuilt right before the reader, so no view
of a slot outlives the residency it came from), and the plan's actions become nodes::

    fetch       = pscompile.fetch(slot_1, host_4)                  # chunk 4 -> slot 1, 2.0 MiB
    t_7         = aten.t(aten.view(aten.slice(slot_1, 0, 512, 16896), [128, 128]))
    mm_3        = aten.mm(view_9, t_7)
    store_grad  = pscompile.store_grad(slot_1, mm_9, 512)          # grad of h.0.attn.c_attn.weight
    writeback   = pscompile.writeback(host_4, slot_1)              # dirty chunk 4 goes home
    drop        = pscompile.drop(slot_1)

A parameter larger than a chunk spans several (its pages); its reader gets the pages concatenated,
and its gradient is stored page by page (the last two arguments: first element and count)::

    cat_2       = aten.cat([aten.slice(slot_0, 0, 9216, 16384), aten.slice(slot_3, 0, 0, 9216)])
    wte         = aten.view(cat_2, [256, 64])                      # param wte.weight (chunks 0, 1)
    store_grad  = pscompile.store_grad(slot_0, embedding_dense_backward, 9216, 0, 7168)

The gradients leave the output (each is consumed by its store_grad); the graph returns the loss.
A plan for a micro-batch of gradient accumulation adds its gradients into fp32 accumulation
buffers on the host instead, which the graph takes as placeholders after the host chunks::

    accumulate_grad = pscompile.accumulate_grad(acc_4, mm_9, 512)   # grad of h.0.attn.c_attn.weight
    ...
    wait_grad       = pscompile.wait_grad(mm_9)     # (overlap_grad_copies) its copy has landed

Sharded over ``world`` ranks (ZeRO), each chunk is a communication group whose host placeholder
is this rank's shard, and arrivals, departures and the end of a group's gradients are
collectives (a micro-batch of accumulation reduce-scatters into its fp32 ``acc`` shard)::

    allgather      = pscompile.allgather(slot_0, host_3, 0, 2)      # own shard up, the rest from rank 1
    reduce_scatter = pscompile.reduce_scatter(host_3, slot_0, 0, 2, False)
    release_remote = pscompile.release_remote(slot_0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx

from pscompile.graph import meta as gmeta
from pscompile.memory import nf4
from pscompile.memory.layout import ChunkLayout
from pscompile.kinds import MemKind
from pscompile.graph.ops import MemOp

from .plan_residency import ResidencyPlan

aten = torch.ops.aten


def _page(g) -> tuple[int, ...]:
    """The extra arguments of a store of one page of a gradient (none for a whole gradient)."""
    return () if g.numel < 0 else (g.start, g.numel)


def _view_chain(node: fx.Node) -> list[fx.Node]:
    """Nodes from the parameter placeholder (exclusive) to ``node`` (inclusive), following the
    first argument of each view."""
    chain = []
    while node.op != "placeholder":
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


@dataclass
class _Operands:
    """What the memory nodes of one schedule read: its placeholders, the copied nodes (``env``),
    each gradient's node, the residency replayed while emitting, and the ZeRO rank and world."""

    slots: list
    hosts: list
    accs: list
    env: dict
    grad_node_of: dict
    resident: dict
    rank: int
    world: int


def insert_memory_ops(gm: fx.GraphModule, plan: ResidencyPlan, layout: ChunkLayout, *,
                      param_fqns: tuple[str, ...], grad_fqns: tuple[str, ...],
                      compute_dtype: torch.dtype, nonmodel: Sequence[int] | None = None,
                      world: int = 1, rank: int = 0, per_chunk: bool = False) -> fx.GraphModule:
    """Return a new GraphModule: ``(slot_0.., host_0.., [acc_0..,] buffers.., batch..) -> (loss,)``
    (``acc_*`` placeholders only when the plan accumulates gradients).

    Every node copied from ``gm`` gets metadata of its own (``gm`` is shared by every schedule of
    one capture and is never written): ``src_index``, its index in ``gm``, and ``nonmodel``, its
    entry of the curve this schedule was planned with (when given).

    Long on purpose: the copy of the graph and the parameter views rebuilt at each reader share the new
    graph, the node map and each reader's view cache (the memory nodes are ``_emit``).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    old_nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(old_nodes)}

    def own_meta(new: fx.Node, old: fx.Node) -> fx.Node:
        new.meta[gmeta.KEY] = dict(gmeta.meta(old))
        gmeta.put(new, "src_index", index[old])
        if nonmodel is not None:
            gmeta.put(new, "nonmodel", nonmodel[index[old]])
        return new
    placeholders = [n for n in old_nodes if n.op == "placeholder"]
    param_ph = {n: fqn for n, fqn in zip(placeholders, param_fqns)}
    cs = layout.chunk_size

    home = cs if per_chunk else cs // world   # elements of a chunk's home here (its shard, with ZeRO by group)

    def buffer_placeholder(name: str, key: str, index: int, dtype: torch.dtype = compute_dtype,
                           numel: int = cs) -> fx.Node:
        node = graph.placeholder(f"{name}_{index}")
        node.meta["val"] = torch.empty(numel, dtype=dtype, device="meta")
        gmeta.put(node, key, index)
        return node

    slots = [buffer_placeholder("slot", "slot", k) for k in range(plan.num_slots)]
    # (a chunk kept in NF4 has a home of packed bytes: ``memory/nf4.py``)
    hosts = [buffer_placeholder("host", "host_chunk", c, torch.uint8, numel=nf4.packed_bytes(home))
             if layout.kind(c).packed else buffer_placeholder("host", "host_chunk", c, numel=home)
             for c in range(layout.num_chunks)]
    accs = ([buffer_placeholder("acc", "acc_chunk", c, torch.float32, numel=home) for c in range(layout.num_chunks)]
            if any(a.kind == MemKind.ACCUMULATE_GRAD or a.to_acc for a in plan.actions) else [])
    for n in placeholders:
        if n not in param_ph:
            env[n] = own_meta(graph.node_copy(n, lambda a: env[a]), n)

    resident: dict[int, int] = dict(plan.initial)      # chunk -> slot, replayed while emitting
    actions = {}
    for a in plan.actions:
        actions.setdefault(a.before, []).append(a)
    output_node = next(n for n in old_nodes if n.op == "output")
    loss_node, *grad_nodes = output_node.args[0]
    grad_node_of = dict(zip(grad_fqns, grad_nodes))

    def page(fqn: str, i: int, p) -> fx.Node:
        flat = graph.call_function(aten.slice.Tensor, (slots[resident[p.chunk]], 0, p.chunk_offset,
                                                       p.chunk_offset + p.numel))
        flat.meta["val"] = torch.empty(p.numel, dtype=compute_dtype, device="meta")
        gmeta.put(flat, "page", (fqn, i))
        return flat

    def param_root(fqn: str) -> fx.Node:
        """The parameter as a tensor: a view of its slot, or (a tensor spanning chunks) its pages
        concatenated -- a gathered copy its reader holds, which the non-model curve counts."""
        e = layout.entry(fqn)
        pages = [page(fqn, i, p) for i, p in enumerate(e.pieces)]
        flat = pages[0]
        if e.spans:
            flat = graph.call_function(aten.cat.default, (pages,))
            flat.meta["val"] = torch.empty(e.numel, dtype=compute_dtype, device="meta")
            gmeta.put(flat, "param", fqn)
            gmeta.put(flat, "gather", fqn)
        view = graph.call_function(aten.view.default, (flat, list(e.shape)))
        view.meta["val"] = torch.empty(e.shape, dtype=compute_dtype, device="meta")
        gmeta.put(view, "param", fqn)
        return view

    def rebuild(arg: fx.Node, cache: dict) -> fx.Node:
        """A fresh copy of the view chain behind ``arg``, rooted at the current slot (one root per
        parameter and reader: a tensor spanning chunks is gathered once for its reader)."""
        if arg in cache:
            return cache[arg]
        chain = _view_chain(arg)
        root_ph = chain[0].args[0] if chain else arg
        fqn = param_ph[root_ph]
        if ("root", fqn) not in cache:
            cache[("root", fqn)] = param_root(fqn)
        cur = cache[("root", fqn)]
        local = {root_ph: cur}
        for v in chain:
            cur = own_meta(graph.node_copy(v, lambda a: local.get(a, env.get(a))), v)
            local[v] = cur
        cache[arg] = cur
        return cur

    operands = _Operands(slots, hosts, accs, env, grad_node_of, resident, rank, world)
    for i, n in enumerate(old_nodes):
        for a in actions.get(i, ()):
            _emit(graph, a, operands)
        if n.op == "placeholder" or gmeta.get(n, "param") is not None:
            continue              # parameters and their views are re-created at each reader
        if n.op == "output":
            break
        cache: dict = {}

        def arg_map(a):
            if gmeta.get(a, "param") is not None:
                return rebuild(a, cache)
            return env[a]
        env[n] = own_meta(graph.node_copy(n, arg_map), n)
    for a in actions.get(len(old_nodes), ()):        # end of the iteration
        _emit(graph, a, operands)
    graph.output((env[loss_node],))
    graph.lint()
    out = gmeta.graph_module(gm, graph)
    return out


def _emit(graph: fx.Graph, a, op: "_Operands") -> None:
    """The memory node of plan action ``a`` (its op and ``MemOp`` metadata) at the end of ``graph``;
    ``op.resident`` follows the chunks that arrive and leave."""
    slots, hosts, accs, env, grad_node_of = op.slots, op.hosts, op.accs, op.env, op.grad_node_of
    resident, rank, world = op.resident, op.rank, op.world
    if a.kind == MemKind.FETCH:
        args = (slots[a.slot], hosts[a.chunk])
        mem = MemOp(MemKind.FETCH, a.chunk, a.slot, "host", "device", a.nbytes,
                    asynchronous=a.asynchronous)
    elif a.kind == MemKind.ALLGATHER:
        args = (slots[a.slot], hosts[a.chunk], rank, world)
        mem = MemOp(MemKind.ALLGATHER, a.chunk, a.slot, "host+ranks", "device", a.nbytes,
                    asynchronous=a.asynchronous, comm_bytes=a.comm_bytes, world=world)
    elif a.kind == MemKind.BROADCAST:
        owner = a.chunk % world
        args = (slots[a.slot], hosts[a.chunk], owner, rank)
        mem = MemOp(MemKind.BROADCAST, a.chunk, a.slot, "host" if owner == rank else f"rank {owner}", "device",
                    a.nbytes, asynchronous=a.asynchronous, comm_bytes=a.comm_bytes, world=world)
    elif a.kind == MemKind.REDUCE:
        owner = a.chunk % world
        dest = accs[a.chunk] if a.to_acc else hosts[a.chunk]
        args = (dest, slots[a.slot], owner, rank, a.to_acc)
        mem = MemOp(MemKind.REDUCE, a.chunk, a.slot, "device+ranks",
                    ("acc" if a.to_acc else "host") if owner == rank else f"rank {owner}",
                    a.nbytes, comm_bytes=a.comm_bytes, world=world)
    elif a.kind == MemKind.RELEASE_REMOTE:
        args = (slots[a.slot],)
        mem = MemOp(MemKind.RELEASE_REMOTE, a.chunk, a.slot, "device", "-", 0, world=world)
    elif a.kind == MemKind.REDUCE_SCATTER:
        dest = accs[a.chunk] if a.to_acc else hosts[a.chunk]
        args = (dest, slots[a.slot], rank, world, a.to_acc)
        mem = MemOp(MemKind.REDUCE_SCATTER, a.chunk, a.slot, "device+ranks", "acc" if a.to_acc else "host",
                    a.nbytes, comm_bytes=a.comm_bytes, world=world)
    elif a.kind == MemKind.WAIT and a.slot is None:     # an asynchronous accumulate_grad has landed
        g = a.grad
        args = (env[grad_node_of[g.fqn]],)
        mem = MemOp(MemKind.WAIT, a.chunk, None, "-", "-", 0, g.fqn)
    elif a.kind == MemKind.WAIT:
        args = (slots[a.slot],)
        mem = MemOp(MemKind.WAIT, a.chunk, a.slot, "-", "-", 0, world=world)
    elif a.kind == MemKind.WRITEBACK:
        args = (hosts[a.chunk], slots[a.slot])
        mem = MemOp(MemKind.WRITEBACK, a.chunk, a.slot, "device", "host", a.nbytes)
    elif a.kind == MemKind.DISK_READ:
        args = (hosts[a.chunk],)
        mem = MemOp(MemKind.DISK_READ, a.chunk, None, "disk", "host", a.nbytes)
    elif a.kind == MemKind.UPDATE:
        args = (hosts[a.chunk],)
        mem = MemOp(MemKind.UPDATE, a.chunk, None, "host", "host", 0)
    elif a.kind == MemKind.DROP:
        args = (slots[a.slot],)
        mem = MemOp(MemKind.DROP, a.chunk, a.slot, "device", "-", 0)
    elif a.kind == MemKind.ACCUMULATE_GRAD:
        g = a.grad
        args = (accs[a.chunk], env[grad_node_of[g.fqn]], g.offset, *_page(g))
        mem = MemOp(MemKind.ACCUMULATE_GRAD, a.chunk, None, "device", "host", a.nbytes, g.fqn,
                    asynchronous=a.asynchronous)
    else:
        g = a.grad
        grad = env[grad_node_of[g.fqn]]
        dest = slots[a.slot] if a.slot is not None else hosts[a.chunk]
        args = (dest, grad, g.offset, *_page(g))
        mem = MemOp(MemKind.STORE_GRAD, a.chunk, a.slot, "device", "device" if a.slot is not None else "host",
                    a.nbytes, g.fqn)
    node = graph.call_function(mem.decl.op, args)      # the op its declaration names
    if mem.decl.arrives:
        resident[a.chunk] = a.slot
    elif mem.decl.leaves:
        del resident[a.chunk]
    node.meta["val"] = None
    gmeta.put(node, "mem", mem)
