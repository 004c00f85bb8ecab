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
    return mem.decl.tier or f"{mem.src}->{mem.dst}"


def _memory_comment(mem: MemOp, layout, n: fx.Node) -> str:
    """The op's own comment (its declaration's), else its ``describe``."""
    comment = mem.decl.comment
    return comment(mem, n) if comment is not None else mem.describe()


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
