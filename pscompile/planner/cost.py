"""The cost model: an iteration's time from its schedule, as two copy engines and one compute
stream would run it.

Walk the captured graph in order with a compute clock and one clock per copy direction
(host->device, device->host; PCIe is full duplex) and one for GPU-GPU collectives:

- each executed node costs ``op_overhead_s`` plus, for matmuls, convolutions and attention
  (``torch.utils.flop_counter``'s formulas), its FLOPs at ``peak_flops * efficiency``, and for
  anything else the bytes it reads and writes at ``memory_bandwidth`` (views cost only the
  overhead);
- a memory action before a node starts when both the compute stream reaches it and its copy
  engine is free; an asynchronous one (a prefetch, an overlapped gradient copy) lets compute go
  on until its ``WAIT``, a synchronous one holds compute until it lands;
- ZeRO collectives move their ``comm_bytes`` at ``interconnect`` on their own clock, the rank's
  own shard over PCIe; an activation offload or reload is a copy that compute does not wait for
  until the saved value's next use (offloads run one ahead);
- fetches for the next step (``plan_lookahead``) start when compute ends, each once its chunk's
  gradient has landed and the host has updated it; a step that starts with such chunks in flight
  is the steady state when it fetches the same ones ahead itself: it is walked once as if they had
  landed, then again with what that walk left in flight at its end. Chunks in flight that it does
  not fetch ahead are on the host->device engine from its start;
- the iteration ends when compute and every copy are done, then the optimizer runs: the chunks
  whose optimizer states live on the host at ``cpu_bandwidth`` (shared by the node's GPUs), the
  rest at ``memory_bandwidth``, ``ADAM_BYTES_PER_PARAM`` bytes per parameter.

Throughput counts the model's FLOPs, not the recomputed ones (as the papers do): the matmul
FLOPs of the capture before any activation rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import fx

from pscompile.graph.meta import get
from pscompile.graph.ops import decl_for, is_activation_node, is_offload
from pscompile.kinds import MemKind
from pscompile.memory import nf4
from pscompile.planner.hardware import ADAM_BYTES_PER_PARAM, Hardware

__all__ = ["Cost", "graph_flops", "node_flops", "estimate"]


@dataclass(frozen=True)
class Cost:
    """Estimated seconds of one iteration and where they go."""

    compute_s: float        # the nodes alone, nothing waiting
    forward_backward_s: float   # with the transfers as the schedule overlaps them
    optimizer_s: float
    h2d_s: float            # busy time of each copy engine
    d2h_s: float
    collective_s: float
    model_flops: int        # per GPU per iteration, without recomputation

    @property
    def iteration_s(self) -> float:
        return self.forward_backward_s + self.optimizer_s

    @property
    def tflops(self) -> float:
        """Model TFLOP/s per GPU."""
        return self.model_flops / self.iteration_s / 1e12


def _tensors(value) -> list[torch.Tensor]:
    vals = value if isinstance(value, (tuple, list)) else (value,)
    return [t for t in vals if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_flops(node: fx.Node) -> int:
    """FLOPs of a matmul, convolution or attention node (``torch.utils.flop_counter``); 0 else."""
    from torch.utils.flop_counter import flop_registry
    fn = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if fn is None or "val" not in node.meta:
        return 0
    val = lambda a: a.meta["val"]      # noqa: E731
    return int(fn(*fx.map_arg(node.args, val), **fx.map_arg(node.kwargs, val), out_val=node.meta["val"]))


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _memory_bytes(node: fx.Node) -> int:
    """Bytes a non-matmul node reads and writes (its tensor inputs and outputs)."""
    if _is_view(node):
        return 0
    ins = [a for a in node.all_input_nodes if "val" in a.meta]
    return sum(_nbytes(t) for a in ins for t in _tensors(a.meta["val"])) + \
        sum(_nbytes(t) for t in _tensors(node.meta.get("val")))


def graph_flops(gm: fx.GraphModule) -> int:
    """The matmul FLOPs of a graph (forward, backward and whatever else it holds)."""
    return sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")


def estimate(scheduled, hw: Hardware, *, model_flops: int, host_params: int, device_params: int,
             disk_s: float = 0.0, dequantized: frozenset[int] = frozenset()) -> Cost:
    """The cost of one iteration of ``scheduled`` (a ``pipeline.Scheduled``) on one GPU of ``hw``.
    ``host_params`` / ``device_params``: parameters this GPU updates with optimizer states on the
    host / on the device; ``disk_s``: the disk tier's reads and writes of one update, which run
    behind the host's updates (the next disk chunk is read while one updates), so the host
    optimizer takes the longer of the two. ``dequantized``: the chunks kept in NF4, whose fetch
    moves its packed bytes (the plan's) and, once landed, costs the GPU reading them and writing
    the compute-dtype chunk at ``memory_bandwidth``.

    Long on purpose: one replay of the schedule's timeline (compute per node, each copy engine, the
    collectives, the optimizer), whose running clocks every part of it advances.
    """
    captured, plan = scheduled.captured, scheduled.plan
    nodes = list(captured.gm.graph.nodes)
    rate = hw.peak_flops * hw.efficiency
    costs: list[float] = []
    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr") or get(n, "param") is not None:
            costs.append(0.0)
        elif is_activation_node(n):
            costs.append(0.0)          # a copy: charged on the copy engines below
        else:
            f = node_flops(n)
            costs.append(hw.op_overhead_s + (f / rate if f else _memory_bytes(n) / hw.memory_bandwidth))
    by_node: dict[int, list] = {}
    for a in plan.actions:
        by_node.setdefault(a.before, []).append(a)

    shared = hw.gpus                       # the node's GPUs share its host memory bandwidth
    optimizer = max(host_params * ADAM_BYTES_PER_PARAM * shared / hw.cpu_bandwidth, disk_s) + \
        device_params * ADAM_BYTES_PER_PARAM / hw.memory_bandwidth
    # Fetches for the next step (module docstring): the step ends with its optimizer, and the
    # next one starts with what has not landed yet.
    ahead = scheduled.lookahead.chunks if scheduled.lookahead is not None else ()
    elsize = torch.empty((), dtype=captured.param_dtype or torch.float32).element_size()
    update_s = plan.slot_bytes / elsize * ADAM_BYTES_PER_PARAM * shared / hw.cpu_bandwidth
    moved = {a.chunk: a.nbytes for a in plan.actions if a.grad is None and a.kind == MemKind.FETCH}
    dequant_s = (nf4.packed_bytes(plan.slot_bytes // elsize) + plan.slot_bytes) / hw.memory_bandwidth  # read, write

    def landing(c: int) -> float:
        """What an arrived chunk costs the GPU: dequantizing an NF4 chunk."""
        return dequant_s if c in dequantized else 0.0
    arriving: list[int] = []               # chunks the step waits for without fetching them
    fetched: set[int] = set()
    for a in sorted(plan.actions, key=lambda a: a.before):
        if a.grad is None and a.kind == MemKind.FETCH:
            fetched.add(a.chunk)
        elif a.grad is None and a.kind == MemKind.WAIT and a.chunk not in fetched and a.chunk not in arriving:
            arriving.append(a.chunk)

    def walk(lands: dict[int, float | None], h2d_free: float):
        """``lands``: an arriving chunk -> when it lands, None: fetched from the step's start."""
        t, h2d, d2h, comm = 0.0, h2d_free, 0.0, 0.0
        busy = {"h2d": 0.0, "d2h": 0.0, "comm": 0.0}
        pending: dict[tuple, float] = {}   # an asynchronous action's landing time, until its WAIT
        copy_ready: dict[str, float] = {}  # activation copies: name of the saved value -> landing time
        grads: dict[int, float] = {}       # a chunk fetched ahead -> when its last gradient landed

        def on_link(direction: str, start: float, nbytes: int) -> float:
            nonlocal h2d, d2h
            dur = nbytes / hw.pcie
            busy[direction] += dur
            if direction == "h2d":
                h2d = max(h2d, start) + dur
                return h2d
            d2h = max(d2h, start) + dur
            return d2h

        def collective(start: float, nbytes: int) -> float:
            nonlocal comm
            dur = nbytes / hw.interconnect
            busy["comm"] += dur
            comm = max(comm, start) + dur
            return comm

        for c, at in lands.items():
            pending[(c, False)] = on_link("h2d", 0.0, moved.get(c, plan.slot_bytes)) if at is None else at

        for i in range(len(nodes) + 1):
            for a in by_node.get(i, ()):
                key = (a.chunk, a.grad is not None)
                decl = decl_for(a.kind, slot=a.slot)
                if decl.waits:
                    t = max(t, pending.pop(key, t)) + (landing(a.chunk) if a.grad is None else 0.0)
                    continue
                if decl.link not in ("h2d", "d2h"):      # no bytes, or a disk read (the optimizer's term)
                    continue
                start = collective(t, a.comm_bytes) if decl.comm == "before" else t
                end = on_link(decl.link, start, a.nbytes) if a.nbytes else start
                if decl.comm == "alongside":
                    end = max(end, collective(t, a.comm_bytes))
                if a.asynchronous:
                    pending[key] = max(pending.get(key, 0.0), end)
                else:
                    t = end + (landing(a.chunk) if a.kind == MemKind.FETCH else 0.0)
                if a.kind == MemKind.STORE_GRAD and a.chunk in ahead:
                    grads[a.chunk] = max(grads.get(a.chunk, 0.0), end)
            if i == len(nodes):
                break
            n = nodes[i]
            if is_activation_node(n):
                val = n.meta.get("val")
                nbytes = sum(_nbytes(x) for x in _tensors(val)) if not is_offload(n) else \
                    sum(_nbytes(x) for a in n.all_input_nodes for x in _tensors(a.meta.get("val")))
                copy_ready[n.name] = on_link("d2h" if is_offload(n) else "h2d", t, nbytes)
                continue
            for a in n.all_input_nodes:          # a reloaded value must have landed before its use
                if a.name in copy_ready and not is_offload(a):
                    t = max(t, copy_ready.pop(a.name))
            t += costs[i]
        end = max([t, h2d, d2h, comm] + list(pending.values()) + list(copy_ready.values()))
        landed, updated = {}, t               # updates start when compute ends, each once its gradient landed
        for c in ahead:
            updated = max(updated, grads.get(c, t)) + update_s
            landed[c] = on_link("h2d", updated, moved.get(c, plan.slot_bytes))
        return end, landed, busy

    end, landed, busy = walk({c: 0.0 if c in ahead else None for c in arriving}, 0.0)
    if any(c in ahead for c in arriving):
        step = end + optimizer
        left = {c: max(0.0, landed[c] - step) if c in landed else None for c in arriving}
        end, _, busy = walk(left, max([0.0] + [at - step for at in landed.values()]))
    return Cost(compute_s=sum(costs), forward_backward_s=end, optimizer_s=optimizer, h2d_s=busy["h2d"],
                d2h_s=busy["d2h"], collective_s=busy["comm"], model_flops=model_flops)
