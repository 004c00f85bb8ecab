"""Inductor's buffer plan: what a compiled program's own code allocates, around each memory node.

``buffer_events(graph)`` reads it off Inductor's generated wrapper (``KeepGraph`` keeps the graph
the compile made) as a list of allocations, aliases, frees and memory-op calls whose sizes are
sympy expressions in the program's size symbols; ``replay(events, values)`` turns them into a
``BufferPlan`` at given sizes: the bound's for a range's program when it is checked, each new
length's when it runs (``compiled/whole.py``, ``compiled/lowering.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch

from pscompile.graph.ops import DECLS

__all__ = ["BufferPlan", "KeepGraph", "UnreadWrapperLine", "buffer_events", "replay"]

_MEMORY = frozenset(d.op for d in DECLS.values())
# ops whose output Inductor allocates as a host buffer (their declarations say so): not device bytes
_HOST_OUTPUT = frozenset(d.op for d in DECLS.values() if d.returns == "host")

# Inductor's wrapper lines, by class name (a class that a torch version drops is simply never seen):
# those ``buffer_events`` reads, and those that allocate nothing (they call kernels into buffers
# allocated by other lines, assert, comment, define symbols, or enter and leave a device context).
_READ = frozenset({"AllocateLine", "ReuseLine", "ReinterpretLine", "FreeIfNotReusedLine", "FreeLine",
                   "MultiOutputLine", "ExternKernelAllocLine"})
_NO_ALLOCATION = frozenset({
    "ExternKernelOutLine", "ExternKernelMultiOutLine", "IndexPutFallbackLine", "ScatterFallbackLine",
    "KernelCallLine", "KernelDefinitionLine", "DynamicScalarLine", "SymbolicCallArgLine",
    "UnbackedSymbolDefsLine", "AssertDivByZeroLine", "AssertSizeStrideLine", "CommentLine", "NullLine",
    "EnterDeviceContextManagerLine", "ExitDeviceContextManagerLine", "EnterCudaStreamContextLine",
    "ExitCudaStreamContextLine", "EnterDeviceContextManagerWithStreamInfoLine",
    "ExitDeviceContextManagerWithStreamInfoLine"})


class UnreadWrapperLine(ValueError):
    """Inductor's wrapper has a line ``buffer_events`` does not know (a subgraph, or a class a newer
    torch added): its buffer plan cannot be read, so the program's bytes are not known."""


@dataclass(frozen=True)
class BufferPlan:
    """Inductor's buffers around each memory node, in graph order: ``inside[k]``, the most bytes
    they hold in the compute between memory node k-1 and memory node k; ``at[k]``, the bytes live
    while memory node k runs; ``after`` the most after the last one. Host copies (offloads) are
    not device bytes and are left out."""

    inside: tuple[int, ...]
    at: tuple[int, ...]
    after: int

    @property
    def peak(self) -> int:
        return max((*self.inside, *self.at, self.after), default=0)



class KeepGraph:
    """A post-fusion scheduler pass that changes nothing and keeps Inductor's graph (its wrapper's
    lines, with their buffer plan, are read after the compile: ``buffer_events``)."""

    def __init__(self):
        self.graph = None

    def __call__(self, nodes: list) -> list:
        from torch._inductor.virtualized import V
        self.graph = V.graph
        return nodes


def buffer_events(graph) -> list[tuple]:
    """Inductor's buffer plan as events, from its generated wrapper's lines in order (after its
    buffer-reuse planning): an ``AllocateLine`` allocates (``("new", name, bytes)``, the bytes a
    sympy expression in the program's size symbols), a ``ReuseLine`` or ``ReinterpretLine`` gives
    a new name to an existing allocation (``"alias"``), a free (``FreeIfNotReusedLine`` not
    reused, ``FreeLine``) drops a name (``"release"``), as Python's references in the generated
    code do. An extern kernel's outputs are allocated where it runs; a memory op's call is
    ``("memory",)`` after the bytes it allocates; an offload's output (a host copy) is not counted."""
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as w
    sizes = graph.sizevars

    def nbytes(node) -> Any:
        expr = sizes.remove_precomputed_replacements(sympy.sympify(node.get_layout().storage_size()))
        return expr * node.get_dtype().itemsize

    events: list[tuple] = []
    host: set[str] = set()               # offload kernels: their outputs are host copies
    for line in graph.wrapper_code.lines:
        name = type(line).__name__
        if isinstance(line, w.WrapperLine) and name not in _READ and name not in _NO_ALLOCATION:
            raise UnreadWrapperLine(f"Inductor's wrapper line {name} is not one pscompile reads for its buffer "
                                    f"plan (torch {torch.__version__}); known: {sorted(_READ | _NO_ALLOCATION)}")
        if isinstance(line, w.AllocateLine):
            events.append(("new", line.node.get_name(), nbytes(line.node)))
        elif isinstance(line, (w.ReuseLine, w.ReinterpretLine)):
            events.append(("alias", line.node.get_name(), line.reused_as.get_name()))
            if isinstance(line, w.ReuseLine) and line.delete_old:
                events.append(("release", line.node.get_name()))
        elif isinstance(line, w.FreeIfNotReusedLine):
            if not line.is_reused:
                events.append(("release", line.node.get_name()))
        elif isinstance(line, w.FreeLine):
            events.append(("release", line.node.get_name()))
        elif isinstance(line, w.MultiOutputLine):
            if line.result_name in graph.name_to_buffer and line.arg_name not in host:
                events.append(("new", line.result_name, nbytes(graph.name_to_buffer[line.result_name])))
        elif isinstance(line, w.ExternKernelAllocLine):
            node, op = line.node, getattr(line.node, "op_overload", None)
            if op in _MEMORY:
                events.append(("before",))
            if op in _HOST_OUTPUT:
                host.add(node.get_name())
            elif isinstance(node.layout, ir.MultiOutputLayout):
                events.append(("new", node.get_name(), 0))         # (its outputs: MultiOutputLine)
            elif not isinstance(node.layout, ir.NoneLayout):
                events.append(("new", node.get_name(), nbytes(node)))
            if op in _MEMORY:
                events.append(("memory",))
    return events


def replay(events: Sequence[tuple], values: dict) -> BufferPlan:
    """The ``BufferPlan`` of ``buffer_events`` for sizes ``values`` (symbol -> int): an allocation
    is given back when its last name goes; the device bytes live when each memory op is called,
    and the most between two of them."""
    alloc_of: dict[str, int] = {}
    refs: dict[int, int] = {}
    size: dict[int, int] = {}
    live = peak = 0
    inside, at = [], []
    for ev in events:
        kind = ev[0]
        if kind == "new":
            a = len(size) + 1
            alloc_of[ev[1]], refs[a] = a, 1
            size[a] = int(sympy.sympify(ev[2]).xreplace(values)) if not isinstance(ev[2], int) else ev[2]
            live += size[a]
        elif kind == "alias":
            a = alloc_of.get(ev[1])
            if a is not None:
                alloc_of[ev[2]] = a
                refs[a] += 1
        elif kind == "release":
            a = alloc_of.pop(ev[1], None)
            if a is not None:
                refs[a] -= 1
                live -= size[a] if refs[a] == 0 else 0
        elif kind == "before":
            inside.append(max(peak, live))
            continue
        elif kind == "memory":
            at.append(live)
            peak = live
            continue
        peak = max(peak, live)
    return BufferPlan(tuple(inside), tuple(at), peak)
