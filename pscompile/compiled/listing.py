"""How one node of a scheduled graph reads in ``Schedule``'s listing and table: its op, kind, slot,
tier, the comment on a memory node, its code with long arguments cut, and its model source line."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import torch
from torch import fx

from pscompile.graph.meta import get
from pscompile.graph.ops import MemOp, activation_move, is_memory_node, mem_op
from pscompile.kinds import MemKind
from pscompile.units import format_bytes

_MAX_ARGS = 100          # characters of an argument list before it is cut with "..."
_NONE = "-"              # an empty cell


def _op_name(n: fx.Node) -> str:
    if n.op in ("placeholder", "output"):
        return n.op
    if n.op == "get_attr":
        return "get_attr"
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"{t._qualified_op_name.replace('::', '.')}"
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def _kind(n: fx.Node) -> str:
    if is_memory_node(n):
        return "memory"
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if get(n, "param") is not None or (n.target is torch.ops.aten.slice.Tensor and isinstance(n.args[0], fx.Node)
                                       and get(n.args[0], "slot") is not None):
        return "param_view"
    return "compute"


def _slot_of(n: fx.Node) -> int | None:
    """The device slot a parameter view chain (slice of a slot, then views) starts from, if any."""
    for _ in range(32):
        if n.op == "placeholder":
            return get(n, "slot")
        if get(n, "param") is None and n.target is not torch.ops.aten.slice.Tensor:
            return None
        if not n.args or not isinstance(n.args[0], fx.Node):
            return None
        n = n.args[0]
    return None


def _tier(n: fx.Node, mem: MemOp | None) -> str:
    if mem is None:
        return "device" if (get(n, "param") is not None or get(n, "reads")) else ""
    if mem.kind.leaves:
        return "device (evict)" if mem.kind == MemKind.DROP else "device (release remote)"
    if mem.kind == MemKind.WAIT:
        return "device->host (wait)" if mem.slot is None else "host->device (wait)"
    return f"{mem.src}->{mem.dst}"


def _memory_comment(mem: MemOp, layout, n: fx.Node) -> str:
    b = format_bytes(mem.nbytes)
    if mem.kind == MemKind.FETCH:
        early = ", started early (async)" if mem.asynchronous else ""
        return f"fetch chunk {mem.chunk} -> slot {mem.slot} ({mem.src}->{mem.dst}), {b}{early}"
    if mem.kind == MemKind.WAIT and mem.slot is None:
        return f"wait for the copy of {mem.fqn}'s gradient to chunk {mem.chunk}'s accumulation buffer (then freed), 0 B"
    if mem.kind == MemKind.WAIT:
        what = "group" if mem.world > 1 else "chunk"
        return f"wait for {what} {mem.chunk} in slot {mem.slot} (prefetched), 0 B"
    if mem.kind == MemKind.ALLGATHER:
        early = ", started early (async)" if mem.asynchronous else ""
        return (f"allgather group {mem.chunk} -> slot {mem.slot}: own shard host->device {b}, "
                f"{format_bytes(mem.comm_bytes)} from ranks 0-{mem.world - 1}{early}")
    if mem.kind == MemKind.BROADCAST:
        early = ", started early (async)" if mem.asynchronous else ""
        return (f"broadcast chunk {mem.chunk} -> slot {mem.slot} from its owner rank {mem.chunk % mem.world} "
                f"({mem.src}->device), link {b}, {format_bytes(mem.comm_bytes)} received{early}")
    if mem.kind == MemKind.REDUCE:
        return (f"reduce chunk {mem.chunk} in slot {mem.slot} to its owner rank {mem.chunk % mem.world} "
                f"(-> {mem.dst}), {format_bytes(mem.comm_bytes)} sent, link {b}")
    if mem.kind == MemKind.RELEASE_REMOTE:
        return f"release group {mem.chunk} from slot {mem.slot} (remote shards dropped, slot freed), 0 B moved"
    if mem.kind == MemKind.REDUCE_SCATTER:
        where = "added into its fp32 accumulation shard" if mem.dst == "acc" else "to its host shard"
        return (f"reduce_scatter group {mem.chunk} in slot {mem.slot}: sum over ranks 0-{mem.world - 1}, "
                f"{format_bytes(mem.comm_bytes)} sent, own shard {where}, {b}")
    if mem.kind == MemKind.WRITEBACK:
        return f"writeback chunk {mem.chunk} <- slot {mem.slot} ({mem.src}->{mem.dst}), {b}"
    if mem.kind == MemKind.DROP:
        return f"evict chunk {mem.chunk} from slot {mem.slot} (device, slot freed), {b} moved"
    if mem.kind == MemKind.UPDATE:
        return (f"update chunk {mem.chunk}: its AdamW step starts on a host thread while the backward "
                f"goes on, {b} moved")
    if mem.kind == MemKind.ACCUMULATE_GRAD:
        early = ", async: the gradient lives until its wait" if mem.asynchronous else ""
        return (f"accumulate_grad {mem.fqn} += into the fp32 accumulation buffer of chunk {mem.chunk} "
                f"({mem.src}->{mem.dst}), {b} moved{early}")
    if mem.kind == MemKind.STORE_GRAD:
        grad = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], fx.Node) else None
        val = grad.meta.get("val") if grad is not None else None
        size = f"grad {format_bytes(val.numel() * val.element_size())}, " if isinstance(val, torch.Tensor) else ""
        where = f"slot {mem.slot}" if mem.slot is not None else "its host copy"
        return (f"store_grad {mem.fqn} -> chunk {mem.chunk} in {where} ({mem.src}->{mem.dst}), "
                f"{size}{b} moved")
    return mem.describe()


def _signature(names: list[str]) -> str:
    """Placeholders, with runs such as slot_0 .. slot_7 shortened to ``slot_0..slot_7``."""
    out: list[str] = []
    i = 0
    while i < len(names):
        prefix, _, num = names[i].rpartition("_")
        if prefix in ("slot", "host", "acc") and num.isdigit():
            j = i
            while j + 1 < len(names) and names[j + 1] == f"{prefix}_{int(num) + (j + 1 - i)}":
                j += 1
            out.append(names[i] if j == i else f"{names[i]}..{names[j]}")
            i = j + 1
        else:
            out.append(names[i])
            i += 1
    return ", ".join(out)


def _fmt(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, list):
        return "[" + ", ".join(_fmt(x) for x in a) + "]"
    if isinstance(a, tuple):
        return "(" + ", ".join(_fmt(x) for x in a) + ("," if len(a) == 1 else "") + ")"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in a.items()) + "}"
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, torch.device):
        return repr(str(a))
    return repr(a)


def _cut(text: str, limit: int = _MAX_ARGS) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _code(n: fx.Node) -> str:
    if n.op == "output":
        return f"return {_cut(_fmt(n.args[0]))}"
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2:
        return f"{n.name} = {_fmt(n.args[0])}[{_fmt(n.args[1])}]"
    args = [_fmt(a) for a in n.args] + [f"{k}={_fmt(v)}" for k, v in n.kwargs.items()]
    if n.op == "call_method":
        return f"{n.name} = {_fmt(n.args[0])}.{n.target}({_cut(', '.join(args[1:]))})"
    if n.op == "get_attr":
        return f"{n.name} = self.{n.target}"
    return f"{n.name} = {_op_name(n)}({_cut(', '.join(args))})"


def _module_of(fqn: str) -> str:
    return fqn.rpartition(".")[0] or fqn


def _few(items: list[str], keep: int = 2) -> str:
    if not items:
        return _NONE
    return ", ".join(items[:keep]) + (f" +{len(items) - keep}" if len(items) > keep else "")


def _short_trace(trace: str) -> str:
    """``file.py:123 in fn`` of the innermost frame of an FX stack trace."""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    if not lines:
        return _NONE
    last = lines[-1]       # File "/path/model.py", line 12, in forward
    try:
        path, line, fn = last.split(", ")[:3]
        return f"{Path(path[6:-1]).name}:{line.split()[-1]} {fn}"
    except ValueError:
        return last[:60]


# ---------------------------------------------------------------- the profiler's names
def profiler_node_name(n: fx.Node) -> str:
    """A memory or activation node as the schedule listing shows it: ``fetch chunk 12 (fetch_3)``
    (the node's name last: a copy it issues is ``copy h2d fetch_3`` on a copy thread's lane)."""
    mem = mem_op(n)
    if mem is not None:
        unit = "group" if mem.world > 1 else "chunk"
        return f"{mem.kind} {unit} {mem.chunk}" + (f" {mem.fqn}" if mem.fqn else "") + f" ({n.name})"
    move = activation_move(n)
    if move is not None:
        return f"{move.kind} {move.value} ({n.name})"
    return n.name


def profiler_region_name(index: int, nodes: list[fx.Node], effects: list[fx.Node] = ()) -> str:
    """``region 7 (h.0.attn .. h.0.mlp)``: the region and the modules whose parameters it reads
    (the first and the last, in order); then the stores into device slots it runs inside
    (``effects``), by node name: ``+ store_grad_3, store_grad_4`` (no range of their own)."""
    params = [get(n, "param") or (get(n, "page") or (None,))[0] for n in nodes]
    modules = list(dict.fromkeys(_module_of(p) for p in params if p))
    where = f" ({modules[0]})" if len(modules) == 1 else f" ({modules[0]} .. {modules[-1]})" if modules else ""
    stores = f" + {', '.join(n.name for n in effects)}" if effects else ""
    return f"region {index}{where}{stores}"
