"""Compute regions: a scheduled graph cut at its memory nodes, and the cache of compiled regions.

The scheduled graph (``insert_memory_ops``) interleaves compute nodes with memory nodes
(``torch.ops.pscompile.*``). Inductor is not trusted with the memory nodes (it keeps their order
but not their place, applies them to copies, and can read a buffer after an in-place fetch
overwrote it; docs/design.md, "Lowering"), so the executor cuts the graph at every memory node into
maximal *compute regions*; each region becomes a small graph, compiled once::

    region 0    arange, embedding(view(slice(slot_0))), ...          compiled (or eager)
    mem         pscompile.fetch(slot_1, host_1)                       run by the executor
    region 1    native_layer_norm(add, [64], p_0, p_1), getitems, ...  compiled
    mem         pscompile.store_grad(slot_1, t_7, 512)                 t_7 is an output of region 1

Rules of the split:

- a multi-output op and its ``getitem`` nodes stay in one region;
- only real tensors cross region boundaries; a *view of a slot or host buffer* never does: a
  region that needs one made elsewhere re-creates the view chain, so no region keeps a parameter
  alive past a memory node;
- *parameters are region inputs* (``lift_params``): the executor makes the ``view(slice(slot_k,
  0, a, b), shape)`` of a parameter right before the region that reads it, so the chunk offset and
  the slot are not baked into the region and the same layer at another place compiles once;
- a region returns what later steps need (values read by later regions, by memory nodes, or the
  graph's outputs); inputs are passed with the *boxed* calling convention (the list is cleared),
  so an input dies inside the region at its last use.

``RegionCache`` maps a structural hash of a region (``region_key``: ops, argument structure with
nodes replaced by positions, constants, and the shape/stride/dtype/device/alignment of every
input) to the compiled callable; identical transformer layers compile once, and a cache shared
between executors keeps compiled regions when a schedule is planned again.

Compilation (``compiled/inductor.py``, which also compiles a range's regions for symbolic sizes) uses
``torch._inductor.standalone_compile(gm, inputs,
dynamic_shapes="from_example_inputs")`` with ``fallback_random=True`` (random ops call ATen, so a
compiled region draws the same dropout mask as eager from the same seed). The inputs are *fake*
tensors with exactly the layout the region will receive (``TensorMeta.fake``): compiling reads
shapes, strides, dtypes and alignment, never values, and no region is ever run on made-up values
(what a compiled region allocates is measured on the inputs it really receives: ``probe.py``).
A region with fewer than ``min_fusible`` ops Inductor could generate code for (only views,
``getitem``s and library calls such as ``mm`` or attention) runs eagerly: nothing to fuse, nothing
to gain. A region Inductor fails to compile also runs eagerly, as *fallback*, with a ``pscompile``
warning naming it (``Region.fallback`` says why).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from pscompile.graph import meta as gmeta
from pscompile.graph.capture import source_line
from pscompile.graph.ops import is_memory_node

__all__ = ["INDUCTOR_PATCHES", "RegionCache", "Region", "TensorMeta", "region_key", "buffer_placeholders",
           "buffer_aliases", "lifted_views", "fusible_ops", "boxed_inner", "eager_fn", "graph_device",
           "eval_chain", "check_region_args", "layout_mismatch", "region_source", "written_inputs", "first_line"]

aten = torch.ops.aten
log = logging.getLogger(__name__)

# Options given to Inductor for every region. fallback_random: random ops call ATen in graph order
# (bit-identical dropout masks to eager for the same seed).
INDUCTOR_PATCHES: dict[str, Any] = {"fallback_random": True}

_ALIGN_BYTES = 16          # Inductor's input alignment assumption (GPU); part of the region key


# ====================================================================== cache
@dataclass
class CacheEntry:
    fn: Callable[[list], Sequence[Any]] | None   # boxed: takes a list of inputs, clears it; None: failed
    compile_s: float
    uses: int = 0
    error: str | None = None     # why the region runs as eager code instead (compile or measurement failed)


class RegionCache:
    """Compiled regions keyed by ``region_key``; share one between executors (and engines'
    re-planned schedules) so a region is compiled once per process."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], CacheEntry] = {}
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._entries

    def get_or_compile(self, key: tuple[str, str], build: Callable[[], Callable]) -> tuple[CacheEntry, bool]:
        """The entry of ``key``, built now on a miss. A build that raises leaves an entry whose
        ``error`` says why (``fn`` None): the region runs as eager code, and is not compiled again."""
        e = self._entries.get(key)
        if e is not None:
            self.hits += 1
            e.uses += 1
            return e, True
        t0 = time.perf_counter()
        try:
            fn, error = build(), None
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: the region falls back to eager code
            fn, error = None, f"{type(exc).__name__}: {first_line(exc)}"
        dt = time.perf_counter() - t0
        e = CacheEntry(fn, dt, 1, error)
        self._entries[key] = e
        self.misses += 1
        self.compile_s += dt
        return e, False

    def fail(self, key: tuple[str, str], error: str) -> None:
        """``key``'s compiled code is not to be run (it failed when measured, or is given inputs of
        another layout): regions of that key run as eager code from now on."""
        e = self._entries.get(key)
        if e is None:
            self._entries[key] = CacheEntry(None, 0.0, 0, error)
        else:
            e.fn, e.error = None, error

    def failures(self, backend: str) -> dict[str, str]:
        """region key -> why its regions run as eager code, for ``backend``'s entries."""
        return {k: e.error for (b, k), e in self._entries.items() if b == backend and e.error is not None}

    def clear(self) -> None:
        self._entries.clear()


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


def lifted_views(gm: fx.GraphModule, buffers: set[fx.Node]) -> set[fx.Node]:
    """Parameter roots: ``slice(buffer, ...)`` and ``view(that slice, shape)`` (contiguous
    parameter tensors that the executor makes and hands to regions as inputs), and for a tensor
    spanning chunks ``cat`` of its page slices and the view of that: the executor gathers it, so a
    region sees the same input whatever the tensor's pages (layers split differently into pages
    still share one compiled region)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not n.args:
            continue
        src = n.args[0]
        if n.target is aten.cat.default and isinstance(src, (list, tuple)) and src \
                and all(isinstance(a, fx.Node) and a in out and a.target is aten.slice.Tensor for a in src):
            out.add(n)
            continue
        if not isinstance(src, fx.Node):
            continue
        if n.target is aten.slice.Tensor and src in buffers:
            out.add(n)
        elif n.target is aten.view.default and src in out and src.target in (aten.slice.Tensor, aten.cat.default):
            out.add(n)
    return out


# Ops that Inductor hands to a library kernel anyway (nothing to fuse): a region made only of
# these and views runs eagerly.
LIBRARY_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
}


def fusible_ops(nodes: Iterable[fx.Node]) -> int:
    """Nodes Inductor can generate code for (not views, getitems or library calls)."""
    return sum(1 for x in nodes if not (is_view_op(x) or x.target is operator.getitem
                                        or x.target in LIBRARY_OPS))


# ====================================================================== structural hash
@dataclass(frozen=True)
class TensorMeta:
    """What a compiled region assumes about one input (the region key hashes it)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    aligned: bool            # storage offset * itemsize is a multiple of 16 bytes

    @staticmethod
    def of(v: Any, device: torch.device) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        dev = device if v.device.type == "meta" else v.device     # slot/host metas are on "meta"
        return TensorMeta(tuple(v.shape), tuple(v.stride()), v.dtype, dev,
                      (v.storage_offset() * v.element_size()) % _ALIGN_BYTES == 0)

    def sig(self) -> tuple:
        return ("T", self.shape, self.stride, str(self.dtype), str(self.device), self.aligned)

    @property
    def span(self) -> int:
        """Elements of storage from the first element to the last (0 for an empty tensor)."""
        return 0 if any(d == 0 for d in self.shape) else \
            1 + sum((d - 1) * st for d, st in zip(self.shape, self.stride))

    def offset(self) -> int:
        """A storage offset (in elements) of this alignment class."""
        return 0 if self.aligned else 1

    def fake(self, mode: FakeTensorMode) -> torch.Tensor:
        """A fake tensor of ``mode`` with exactly this layout (what a region is compiled for; no
        memory is allocated and no value exists)."""
        with mode:
            base = torch.empty(self.offset() + max(self.span, 1), dtype=self.dtype, device=self.device)
            return base.as_strided(self.shape, self.stride, self.offset())

    def example(self) -> torch.Tensor:
        """A real tensor of zeros with this layout. pscompile never compiles, runs or measures a
        region on it (zeros are not what a region receives: indices computed upstream would be
        out of range); it is here for tools that inspect a region by hand."""
        base = torch.zeros(self.offset() + max(self.span, 1), dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, self.offset())

    def mismatch(self, v: Any) -> str | None:
        """How ``v`` differs from this layout (None: it is what the region was compiled for)."""
        if not isinstance(v, torch.Tensor):
            return f"a {type(v).__name__}, not a tensor"
        got = TensorMeta.of(v, v.device)
        for field_, want, have in (("shape", self.shape, got.shape), ("stride", self.stride, got.stride),
                                   ("dtype", self.dtype, got.dtype), ("device", self.device.type, got.device.type),
                                   ("16-byte alignment", self.aligned, got.aligned)):
            if want != have:
                return f"{field_} {have}, compiled for {want}"
        return None


def _sig(v: Any) -> tuple:
    if isinstance(v, torch.Tensor):
        v = TensorMeta.of(v, v.device)
    if isinstance(v, TensorMeta) or hasattr(v, "exprs"):     # (a SymbolicMeta: compiled/inductor.py)
        return v.sig()
    return ("C", type(v).__name__, repr(v))


def graph_device(nodes: Iterable[fx.Node]) -> torch.device:
    """The device the graph computes on: the first non-meta tensor value's device (cpu if none)."""
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            return v.device
    return torch.device("cpu")


def _const(a: Any) -> Any:
    """A hashable, repr-stable form of a node argument constant."""
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_const(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((str(k), _const(v)) for k, v in a.items())))
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return (type(a).__name__, str(a))
    if isinstance(a, float):
        return ("f", a.hex())
    if isinstance(a, (int, bool, str)) or a is None:
        return (type(a).__name__, a)
    return (type(a).__name__, repr(a))


def region_key(graph: fx.Graph, input_metas: Sequence[Any]) -> str:
    """Structural hash of a region graph: op and target of every node, its arguments with nodes
    replaced by their positions, constants, the output structure, and the shape/stride/dtype/
    device/alignment of each input (``input_metas``: one per placeholder, a tensor or what the
    region was compiled for). Node names and where the region came from do not count."""
    index: dict[fx.Node, int] = {}

    def enc(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("n", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(enc(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((str(k), enc(v)) for k, v in a.items())))
        return _const(a)

    parts: list[Any] = []
    metas = iter(input_metas)
    for i, n in enumerate(graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            parts.append(("ph", _sig(next(metas))))
            continue
        t = n.target
        target = t if isinstance(t, str) else str(t) if isinstance(t, torch._ops.OpOverload) else \
            f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"
        parts.append((n.op, target, enc(n.args), enc(dict(n.kwargs))))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# ====================================================================== regions
@dataclass
class Region:
    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    graph: fx.Graph | None = None
    input_metas: list[Any] = field(default_factory=list)
    key: str = ""
    compute: bool = False
    fn: Callable[[list], Sequence[Any]] | None = None
    effects: list[fx.Node] = field(default_factory=list)   # stores into device slots this region's step runs
    deferred: list[fx.Node] = field(default_factory=list)  # those of them the executor runs after the region
    held: list[fx.Node] = field(default_factory=list)      # what they read that the region does not make
    fallback: str | None = None     # why this region runs as eager code though it was to be compiled
    written: frozenset[int] = frozenset()   # positions of the inputs it writes in place (written_inputs)
    ops: int = 0                    # its compute operators (is_compute_op)
    frees: frozenset[int] = frozenset()     # positions of the inputs it is the last reader of
    solo: bool = False              # one operator cut out alone to run as eager code (it fits no other way)
    _eager: Callable[[list], Sequence[Any]] | None = field(default=None, repr=False)

    def eager(self) -> Callable[[list], Sequence[Any]]:
        """The region's graph as eager code (boxed, like ``fn``), made on first use."""
        if self._eager is None:
            self._eager = eager_fn(self.graph)
        return self._eager


def boxed_inner(fn: Callable) -> Callable[[list], Sequence[Any]]:
    """The boxed function under a standalone_compile artifact (so region inputs can be released
    inside the region), marked ``_pscompile_boxed``; falls back to an unboxed call (torch internals
    changed: inputs then live until the region returns)."""
    inner = getattr(getattr(fn, "_compiled_fn", fn), "__wrapped__", None)
    if inner is not None and inner.__closure__ is not None:
        cells = dict(zip(inner.__code__.co_freevars, inner.__closure__))
        if "compiled_fn" in cells and "params_buffers_flat" in cells:
            try:
                boxed, extra = cells["compiled_fn"].cell_contents, cells["params_buffers_flat"].cell_contents
            except ValueError:
                boxed, extra = None, None
            if boxed is not None and not extra and getattr(boxed, "_boxed_call", False):
                def call_boxed(args: list) -> Sequence[Any]:
                    return boxed(args)
                call_boxed._pscompile_boxed = True
                return call_boxed

    def call(args: list) -> Sequence[Any]:
        a = list(args)
        args.clear()
        return fn(*a)
    return call


def written_inputs(graph: fx.Graph) -> frozenset[int]:
    """Positions of the placeholders that ``graph`` writes in place (directly or through a view)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    root = {n: i for i, n in enumerate(placeholders)}
    out = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.args and isinstance(n.args[0], fx.Node) and n.args[0] in root and (
                is_view_op(n) or n.target is operator.getitem):
            root[n] = root[n.args[0]]
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        for arg, value in zip(schema.arguments, n.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, fx.Node) \
                    and value in root:
                out.add(root[value])
    return frozenset(out)


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


def check_region_args(r: Region, args: list) -> None:
    """Raise if ``args`` are not of the layouts ``r`` was compiled for (``layout_mismatch``)."""
    problem = layout_mismatch(r, args)
    if problem is not None:
        raise RuntimeError(f"executor: {problem}")


def layout_mismatch(r: Region, args: Sequence[Any]) -> str | None:
    """Why ``args`` (what the executor passes to region ``r``) are not what ``r`` was compiled for:
    a tensor input of another shape, stride, dtype, device or 16-byte alignment (Inductor's code
    specialises on all of them), or an input the region writes that shares its storage with
    another input (it was compiled for separate storages: a write through one would change what
    the code reads through the other); None when they all match. Read-only inputs may share a
    storage (two parameters of one chunk)."""
    values = None
    for a, m, v in zip(r.inputs, r.input_metas, args):
        if hasattr(m, "exprs"):       # a SymbolicMeta (a range's region: compiled/inductor.py)
            if values is None:
                values = m.bind(r.input_metas, args)
            problem = m.mismatch(v, values)
            if problem is not None:
                return f"region {r.index} ({region_source(r)}) receives node {a.name} as {problem}"
        elif isinstance(m, TensorMeta):
            problem = m.mismatch(v)
            if problem is not None:
                return f"region {r.index} ({region_source(r)}) receives node {a.name} as {problem}"
    if r.written:
        storages = [v.untyped_storage().data_ptr() if isinstance(v, torch.Tensor) else None for v in args]
        for i in r.written:
            other = next((j for j, p in enumerate(storages) if j != i and p is not None and p == storages[i]), None)
            if other is not None:
                return (f"region {r.index} ({region_source(r)}) writes node {r.inputs[i].name}, which shares its "
                        f"storage with input {r.inputs[other].name}; it was compiled for separate storages")
    return None


def region_source(r: Region) -> str:
    """Where region ``r``'s code comes from, for messages: the model source line of its first node
    that has one (captured with ``sources=True``), else the modules whose parameters it reads, else
    its first node."""
    for n in r.nodes:
        src = source_line(n)
        if src:
            return f"{src}; first node {r.nodes[0].name}"
    reads = list(dict.fromkeys(f.rsplit(".", 1)[0] for n in r.nodes for f in gmeta.get(n, "reads", ())))
    if reads:
        more = f" and {len(reads) - 3} more" if len(reads) > 3 else ""
        return f"reads {', '.join(reads[:3])}{more}; first node {r.nodes[0].name}"
    return f"first node {r.nodes[0].name}" if r.nodes else "empty"


def first_line(exc: BaseException) -> str:
    """An exception's message, its first line (at most 500 characters), for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else "(no message)"
