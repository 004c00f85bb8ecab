"""lower_regions: run a scheduled graph with its compute regions compiled by Inductor.

The scheduled graph (``insert_memory_ops``) interleaves compute nodes with memory nodes
(``torch.ops.pscompile.*``). Inductor may not be trusted with the memory nodes (see
"What Inductor does to memory ops" below), so the graph is cut at every memory node into maximal
*compute regions*; each region becomes a small GraphModule compiled once, and the executor runs
the steps in graph order::

    region 0    arange, embedding(view(slice(slot_0))), ...          compiled (or eager)
    mem         pscompile.fetch(slot_1, host_1)                       -> run_memory(node, args)
    region 1    native_layer_norm(add, [64], p_0, p_1), getitems, ...  compiled
    mem         pscompile.store_grad(slot_1, t_7, 512)                 t_7 is an output of region 1
    ...

Rules of the split (torch 2.13 facts, ``/work/shared/notes/torch-2.13-facts.md``):

- a multi-output op and its ``getitem`` nodes stay in one region (a ``getitem`` that the schedule
  placed after a memory node moves back into its op's region: it only unpacks a tuple);
- only real tensors cross region boundaries. A *view of a slot/host buffer* never does: when a
  region needs a buffer view made in an earlier region, the view chain is re-created inside the
  consuming region, so no region keeps a parameter alive past a memory node;
- *parameters are region inputs*. ``insert_memory_ops`` reads a parameter as
  ``view(slice(slot_k, 0, a, b), shape)`` right before each reader. With ``lift_params=True``
  (default) that ``slice``/``view`` pair is evaluated by the executor (a free view, made right
  before the region and released right after it) and the region receives the parameter tensor
  itself; every further view (``t``, ``transpose``, ``expand``...) stays inside the region. The
  chunk offset ``a`` and the slot ``k`` are then not baked into the region, so the same layer at
  another place of another chunk gives the *same* region and is compiled once. With
  ``lift_params=False`` the slices stay inside the regions (offsets become constants of the
  region, and layers only share code when their parameters sit at the same chunk offsets);
- a region returns what later steps need: values read by later regions, by memory nodes (a
  gradient consumed by ``store_grad`` is returned and handed to ``run_memory``) and the graph's
  outputs. Values are released after their last use, and inputs are passed with the *boxed*
  calling convention (the list is cleared) so a region input dies inside the region at its last
  use, as under ``fx.Interpreter(garbage_collect_values=True)``.

``RegionCache`` maps a structural hash of a region (ops, argument structure with nodes replaced by
positions, constants, and shape/stride/dtype/device/alignment of every input) to the compiled
callable; identical transformer layers compile once, and a cache shared between LoweredGraphs
keeps the compiled regions when the schedule is re-planned after the warm-up step.

Compilation uses ``torch._inductor.standalone_compile(gm, example_inputs,
dynamic_shapes="from_example_inputs")``. Measured on this 2-core CPU (torch 2.13): a region that
hits Inductor's on-disk FX graph cache costs 37-48 ms, against 100-260 ms for ``compile_fx`` (no
ShapeEnv: it bypasses the FX graph cache and re-lowers) and ~100-150 ms for ``torch.compile`` (a
Dynamo re-trace per region plus guard checks on every call). The compiled function is called with
the boxed convention (the list of inputs is cleared), so inputs die inside the region. Inductor
runs with ``fallback_random=True``: random ops (the ``bernoulli`` of dropout) call ATen's kernels,
so a compiled region draws the same numbers as eager from the same seed (checked with dropout 0.1:
loss and gradients equal within 1e-7). A region runs eagerly when it has fewer than
``min_fusible`` (default 2) ops Inductor could generate code for, i.e. it is only views,
``getitem``s and library calls (``mm``, ``addmm``, attention): nothing to fuse, so nothing to gain.

Measured (tiny GPT d=64, B=4, T=64, fp32, tight budget; cold = empty Inductor cache, one process):

    layers  nodes  memory nodes  regions  compiled  distinct  cold compile  warm disk cache
    1         257            38       20         7         7        20.5 s            0.3 s
    4         827           138       68        22        11        22.3 s            0.4 s
    12       2332           395      221        46        14        24.0 s            1.0 s

(unlimited budget: 6 / 18 / 50 compiled regions, 6 / 7 / 7 distinct.) Most of a cold compile is
Inductor's one-time start; the layers add almost nothing. Under a tight budget the fetch / wait /
drop nodes fall at places that differ between the first, middle and last layers, so a few more
regions are distinct than with an unlimited budget.

What Inductor does to memory ops (``lower_whole``, experimental)
-----------------------------------------------------------------
``lower_whole(gm)`` compiles the whole scheduled graph with the memory ops inside (they are
``torch.library`` custom ops with fake impls; ``drop``/``wait`` are kept by ``has_side_effect``).
``WholeGraph.compare(inputs)`` runs it next to the eager graph and records, through a
TorchDispatchMode, the memory ops that the compiled code calls (matched to graph nodes by kind and
buffer arguments). Observed with torch 2.13 CPU on the tiny GPT (2 layers, d=64, fp32):

- tight budget (455 nodes, 78 memory nodes: 14 fetch, 14 wait, 14 drop, 8 writeback, 28
  store_grad): all 78 run, in graph order relative to each other, with
  ``reorder_for_peak_memory`` on or off (identical results); only 40 keep their position relative
  to the matmul/attention calls. Only 36 touch the real slot/host buffers: every store_grad but the
  last, and the writebacks/drops after them, act on an Inductor *clone* of the slot (a whole chunk
  of extra memory each) that is copied back into the graph input at the end. The loss is exact,
  but **the gradients of layer 0 and the embeddings are wrong** (host chunks differ by up to
  8.7e-3): the kernel that recomputes ``wte[idx] + wpe[pos]`` for the backward was emitted *after*
  the in-place ``fetch(slot_1, host_6)`` that overwrote wpe's slot, so it read another chunk.
- unlimited budget (no slot is reused; 28 store_grads): correct (max error 6e-8), all 28 in order,
  none on the real buffers (all on clones), 1 of 28 at its eager position (moved by 1-2 matmuls
  either way).

So Inductor keeps the memory ops' relative order but not their position, applies them to copies
(memory the plan does not count) and can read a buffer after a reinplaced mutation of it; the
default lowering keeps every memory op in the executor.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from pscompile.graph import meta as gmeta
from pscompile.graph.ops import MEMORY_OPS, is_memory_node

__all__ = ["LoweringReport", "LoweredGraph", "RegionCache", "lower_regions", "region_key",
           "WholeGraph", "WholeGraphReport", "lower_whole"]

aten = torch.ops.aten

# Options given to Inductor for every region. fallback_random: random ops call ATen in graph order
# (bit-identical dropout masks to eager for the same seed).
INDUCTOR_PATCHES: dict[str, Any] = {"fallback_random": True}

_ALIGN_BYTES = 16          # Inductor's input alignment assumption (GPU); part of the region key


# ====================================================================== reports
@dataclass(frozen=True)
class LoweringReport:
    regions: int            # compute regions (steps between memory nodes)
    compiled: int           # regions run through the backend (the rest: nothing to fuse, eager)
    distinct: int           # distinct compiled regions (by structural hash) in this graph
    compiled_now: int       # distinct regions compiled for this graph (cache misses)
    cache_hits: int         # compiled regions served by the RegionCache
    compile_s: float        # seconds spent compiling (this graph's misses)
    memory_nodes: int
    lifted_views: int       # parameter views (slice/view of a slot) made by the executor
    rebuilt_views: int      # buffer views re-created in a later region (should be 0)
    moved_getitems: int     # getitems moved back into their op's region
    backend: str
    unboxed: int = 0        # compiled regions called unboxed (inputs alive to the region's end; want 0)

    def summary(self) -> str:
        return (f"lower_regions: {self.regions} regions, {self.compiled} compiled, {self.distinct} distinct "
                f"({self.compiled_now} compiled now, {self.cache_hits} cache hits), {self.memory_nodes} memory "
                f"nodes, backend {self.backend}, compiled in {self.compile_s:.1f} s")


# ====================================================================== cache
@dataclass
class _CacheEntry:
    fn: Callable[[list], Sequence[Any]]   # boxed: takes a list of inputs, clears it
    compile_s: float
    uses: int = 0


class RegionCache:
    """Compiled regions keyed by ``region_key``; share one between LoweredGraphs (and engines'
    re-planned schedules) so a region is compiled once per process."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _CacheEntry] = {}
        self.hits = 0
        self.misses = 0
        self.compile_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._entries

    def get_or_compile(self, key: tuple[str, str], build: Callable[[], Callable]) -> tuple[_CacheEntry, bool]:
        e = self._entries.get(key)
        if e is not None:
            self.hits += 1
            e.uses += 1
            return e, True
        t0 = time.perf_counter()
        fn = build()
        dt = time.perf_counter() - t0
        e = _CacheEntry(fn, dt, 1)
        self._entries[key] = e
        self.misses += 1
        self.compile_s += dt
        return e, False

    def clear(self) -> None:
        self._entries.clear()


# ====================================================================== node classes
def _is_view_op(n: fx.Node) -> bool:
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.is_view


def _buffer_placeholders(gm: fx.GraphModule) -> set[fx.Node]:
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


def _buffer_aliases(gm: fx.GraphModule, buffers: set[fx.Node]) -> set[fx.Node]:
    """Nodes whose value is a view of a slot/host buffer (views of views included)."""
    alias = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_memory_node(n) or not n.args:
            continue
        src = n.args[0]
        if isinstance(src, fx.Node) and (src in buffers or src in alias) and (
                _is_view_op(n) or n.target is operator.getitem):
            alias.add(n)
    return alias


def _lifted(gm: fx.GraphModule, buffers: set[fx.Node]) -> set[fx.Node]:
    """Parameter roots: ``slice(buffer, ...)`` and ``view(that slice, shape)`` (contiguous
    parameter tensors that the executor makes and hands to regions as inputs)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        src = n.args[0]
        if n.target is aten.slice.Tensor and src in buffers:
            out.add(n)
        elif n.target is aten.view.default and src in out and src.target is aten.slice.Tensor:
            out.add(n)
    return out


# Ops that Inductor hands to a library kernel anyway (nothing to fuse): a region made only of
# these and views runs eagerly.
_LIBRARY_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
}


def _fusible_ops(nodes: Iterable[fx.Node]) -> int:
    """Nodes Inductor can generate code for (not views, getitems or library calls)."""
    return sum(1 for x in nodes if not (_is_view_op(x) or x.target is operator.getitem
                                        or x.target in _LIBRARY_OPS))


# ====================================================================== structural hash
@dataclass(frozen=True)
class _TMeta:
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
        return _TMeta(tuple(v.shape), tuple(v.stride()), v.dtype, dev,
                      (v.storage_offset() * v.element_size()) % _ALIGN_BYTES == 0)

    def sig(self) -> tuple:
        return ("T", self.shape, self.stride, str(self.dtype), str(self.device), self.aligned)

    def example(self) -> torch.Tensor:
        """A real tensor with this shape, stride, dtype, device and alignment class."""
        span = 0 if any(d == 0 for d in self.shape) else \
            1 + sum((d - 1) * st for d, st in zip(self.shape, self.stride))
        off = 0 if self.aligned else 1
        base = torch.zeros(off + max(span, 1), dtype=self.dtype, device=self.device)
        return base.as_strided(self.shape, self.stride, off)


def _sig(v: Any) -> tuple:
    if isinstance(v, torch.Tensor):
        v = _TMeta.of(v, v.device)
    if isinstance(v, _TMeta):
        return v.sig()
    return ("C", type(v).__name__, repr(v))


def _graph_device(nodes: Iterable[fx.Node]) -> torch.device:
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
class _Region:
    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    graph: fx.Graph | None = None
    input_metas: list[Any] = field(default_factory=list)
    key: str = ""
    compute: bool = False
    fn: Callable[[list], Sequence[Any]] | None = None


@dataclass
class _Step:
    kind: str                         # "region" | "mem" | "eval"
    region: _Region | None = None
    node: fx.Node | None = None
    free: tuple[fx.Node, ...] = ()        # values released after this step
    dead: tuple[fx.Node, ...] = ()        # region outputs nobody reads


def _boxed_inner(fn: Callable) -> Callable[[list], Sequence[Any]]:
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


def _compile_inductor(graph: fx.Graph, metas: Sequence[Any]) -> Callable[[list], Sequence[Any]]:
    gm = fx.GraphModule({}, copy.deepcopy(graph))
    examples = [m.example() if isinstance(m, _TMeta) else m for m in metas]
    art = torch._inductor.standalone_compile(gm, examples, dynamic_shapes="from_example_inputs",
                                             options={"config_patches": dict(INDUCTOR_PATCHES)})
    return _boxed_inner(art)


def _eager_fn(graph: fx.Graph) -> Callable[[list], Sequence[Any]]:
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


class LoweredGraph:
    """A scheduled graph split at its memory nodes, compute regions compiled once each.

    ``run(inputs, run_memory)`` has the semantics of ``gm(*inputs)``: it returns gm's outputs and
    calls ``run_memory(node, args)`` for every memory node, in graph order, with the node's
    evaluated arguments (instead of running the op itself; ``lambda n, a: n.target(*a)`` runs it).

    - ``backend``: "inductor" compiles regions; "eager" runs the same split uncompiled.
    - ``cache``: a RegionCache to share (default: a new one).
    - ``lift_params``: parameter views are region inputs (reuse across layers; see the module doc).
    - ``min_fusible``: regions with fewer ops Inductor could generate code for run eagerly.
    - ``check_inputs``: also check every region input's shape/stride/dtype at run time (debug;
      the graph's own inputs are always checked).
    - ``device``: where slot/host buffers live (default: the device of the graph's values).
    """

    def __init__(self, gm: fx.GraphModule, *, backend: str = "inductor", cache: RegionCache | None = None,
                 lift_params: bool = True, min_fusible: int = 2, check_inputs: bool = False,
                 device: torch.device | str | None = None):
        if backend not in ("inductor", "eager"):
            raise ValueError(f"backend={backend!r}: expected 'inductor' or 'eager'")
        self.gm = gm
        self.backend = backend
        self.cache = cache if cache is not None else RegionCache()
        self.check_inputs = check_inputs
        graph = gm.graph
        nodes = list(graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output_node = next(n for n in reversed(nodes) if n.op == "output")
        buffers = _buffer_placeholders(gm)
        self._aliases = _buffer_aliases(gm, buffers)
        lifted = _lifted(gm, buffers) if lift_params else set()
        self._lifted = lifted

        # ---- assign nodes to steps, in graph order
        steps: list[_Step] = []
        regions: list[_Region] = []
        region_of: dict[fx.Node, _Region] = {}
        cur: _Region | None = None
        moved = 0
        mem_count = 0
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n in lifted:
                continue                                     # made by the executor when needed
            if is_memory_node(n):
                cur = None
                steps.append(_Step("mem", node=n))
                mem_count += 1
                continue
            if n.op != "call_function":
                raise ValueError(f"lower_regions: node {n.name} ({n.op}) is not supported; "
                                 "the scheduled graph should only call functions")
            if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in region_of \
                    and region_of[n.args[0]] is not cur:
                r = region_of[n.args[0]]                     # keep a tuple op with its getitems
                r.nodes.append(n)
                region_of[n] = r
                moved += 1
                continue
            if cur is None:
                cur = _Region(len(regions))
                regions.append(cur)
                steps.append(_Step("region", region=cur))
            cur.nodes.append(n)
            region_of[n] = cur

        # ---- build region graphs
        rebuilt = 0
        for r in regions:
            g = fx.Graph()
            local: dict[fx.Node, fx.Node] = {}
            members = set(r.nodes)

            def get(a: fx.Node, g=g, local=local, r=r, members=members) -> fx.Node:
                nonlocal rebuilt
                if a in local:
                    return local[a]
                if a in self._aliases and a not in lifted and a not in members:
                    # a buffer view from another region: re-create its chain here
                    rebuilt += 1
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
            outs = []
            for n in r.nodes:
                if n in self._aliases:
                    continue                  # views of buffers are re-made where they are read
                if isinstance(n.meta.get("val"), (tuple, list)) and not isinstance(n.meta.get("val"), torch.Size):
                    continue                  # tuples never cross: their getitems are here
                if any(region_of.get(u) is not r for u in n.users):
                    outs.append(n)
            r.outputs = outs
            g.output(tuple(local[o] for o in outs))
            g.lint()
            r.graph = g
            r.compute = _fusible_ops(r.nodes) >= min_fusible

        # ---- buffer views read by a memory node or the output: evaluated by the executor
        evals = {n for n in nodes if n in self._aliases and n not in lifted
                 and any(u.op == "output" or is_memory_node(u) for u in n.users)}
        eager_nodes = lifted | evals | self._aliases

        # ---- input metadata (exact strides / storage offsets of lifted parameter views)
        self.device = device if device is not None else _graph_device(nodes)
        meta_env: dict[fx.Node, Any] = {}

        def meta_value(a: fx.Node) -> Any:
            if a not in meta_env:
                if a in lifted:
                    args = fx.node.map_arg(a.args, meta_value)
                    kwargs = fx.node.map_arg(a.kwargs, meta_value)
                    meta_env[a] = a.target(*args, **kwargs)
                else:
                    v = a.meta.get("val")
                    meta_env[a] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") \
                        if a.op == "placeholder" and isinstance(v, torch.Tensor) else v
            return meta_env[a]

        for r in regions:
            r.input_metas = [_TMeta.of(meta_value(a), self.device) for a in r.inputs]
            r.key = region_key(r.graph, r.input_metas)
        # what the graph's tensor inputs must look like (compiled regions specialise on it)
        self._input_checks = tuple(
            (i, n.name, tuple(v.shape), tuple(v.stride()), v.dtype)
            for i, n in enumerate(self.placeholders)
            if isinstance(v := n.meta.get("val"), torch.Tensor))

        # ---- compile (or wrap) each region, through the cache
        t0 = time.perf_counter()
        hits = compiled_now = 0
        distinct: set[str] = set()
        for r in regions:
            if self.backend == "eager" or not r.compute:
                r.fn = _eager_fn(r.graph)
                continue
            distinct.add(r.key)
            entry, hit = self.cache.get_or_compile(
                (self.backend, r.key), lambda r=r: _compile_inductor(r.graph, r.input_metas))
            if hit:
                hits += 1
            else:
                compiled_now += 1
            r.fn = entry.fn
        compile_s = time.perf_counter() - t0

        # ---- executor program: eager views right before their first reader, frees after last use
        program: list[_Step] = []
        produced: set[fx.Node] = set(self.placeholders)

        def ensure(reads: Iterable[fx.Node]) -> None:
            for a in reads:
                if a in produced or a not in eager_nodes:
                    continue
                for x in _chain(a, eager_nodes):
                    if x not in produced:
                        program.append(_Step("eval", node=x))
                        produced.add(x)

        for s in steps:
            ensure(s.region.inputs if s.kind == "region" else s.node.all_input_nodes)
            program.append(s)
            if s.kind == "region":
                produced.update(s.region.outputs)
        ensure(self.output_node.all_input_nodes)

        last: dict[fx.Node, int] = {}
        for i, s in enumerate(program):
            for a in (s.region.inputs if s.kind == "region" else s.node.all_input_nodes):
                last[a] = i
        keep = set(self.output_node.all_input_nodes)
        frees: dict[int, list[fx.Node]] = {}
        for a, i in last.items():
            if a not in keep:
                frees.setdefault(i, []).append(a)
        for i, s in enumerate(program):
            s.free = tuple(frees.get(i, ()))
            if s.kind == "region":      # outputs nobody reads (none expected): dropped at once
                s.dead = tuple(o for o in s.region.outputs if o not in last and o not in keep)
        self._program = program
        self.regions = regions
        self.report = LoweringReport(
            regions=len(regions), compiled=sum(1 for r in regions if r.compute and backend != "eager"),
            distinct=len(distinct), compiled_now=compiled_now, cache_hits=hits, compile_s=compile_s,
            memory_nodes=mem_count, lifted_views=sum(1 for n in lifted if not any(u in lifted for u in n.users)),
            rebuilt_views=rebuilt, moved_getitems=moved, backend=backend,
            unboxed=sum(1 for r in regions if r.compute and backend != "eager"
                        and not getattr(r.fn, "_pscompile_boxed", False)))

    # ------------------------------------------------------------------ running
    def run(self, inputs: Sequence[torch.Tensor], run_memory: Callable[[fx.Node, tuple], None],
            on_outputs: Callable[[Sequence[Any]], None] | None = None) -> tuple:
        """Run the graph; ``on_outputs(values)`` sees each region's outputs as they appear (memory
        accounting: storages allocated inside compiled code bypass Python dispatch)."""
        if len(inputs) != len(self.placeholders):
            raise ValueError(f"LoweredGraph.run: {len(inputs)} inputs for {len(self.placeholders)} placeholders")
        for i, name, shape, stride, dtype in self._input_checks:
            t = inputs[i]
            if t.shape != shape or t.stride() != stride or t.dtype != dtype:
                raise ValueError(f"LoweredGraph.run: input {i} ({name}) is {tuple(t.shape)} {t.stride()} "
                                 f"{t.dtype}, the graph was lowered for {shape} {stride} {dtype}")
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        check = self.check_inputs
        for s in self._program:
            # no local variable may keep a value alive past its last use: ``args`` is a list the
            # region clears, and ``outs`` / ``args`` are dropped right after use
            if s.kind == "region":
                r = s.region
                args = [env[a] for a in r.inputs]
                if check:
                    _check_args(r, args)
                for a in s.free:                    # the region holds the only reference now
                    del env[a]
                outs = r.fn(args)
                del args
                if on_outputs is not None:
                    on_outputs(outs)
                env.update(zip(r.outputs, outs))     # (a loop variable would keep the last one alive)
                del outs
                for o in s.dead:
                    del env[o]
                continue
            n = s.node
            if s.kind == "mem":
                run_memory(n, fx.node.map_arg(n.args, env.__getitem__))
            else:
                env[n] = n.target(*fx.node.map_arg(n.args, env.__getitem__),
                                  **fx.node.map_arg(n.kwargs, env.__getitem__))
            for a in s.free:
                del env[a]
        out = fx.node.map_arg(self.output_node.args[0], env.__getitem__)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)

    def describe(self) -> str:
        """One line per step: region sizes and keys, memory nodes."""
        lines = []
        for s in self._program:
            if s.kind == "region":
                r = s.region
                how = "eager" if (self.backend == "eager" or not r.compute) else self.backend
                lines.append(f"region {r.index:3d} {len(r.nodes):4d} nodes  in {len(r.inputs):2d} out "
                             f"{len(r.outputs):2d}  {how:8s} {r.key[:10]}")
            elif s.kind == "mem":
                mem = gmeta.get(s.node, "mem")
                lines.append(f"  mem  {mem.describe() if mem is not None else s.node.format_node()}")
            else:
                lines.append(f"  eval {s.node.format_node()}")
        return "\n".join(lines)


def _chain(a: fx.Node, allowed: set[fx.Node]) -> list[fx.Node]:
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


def _check_args(r: _Region, args: list) -> None:
    for a, m, v in zip(r.inputs, r.input_metas, args):
        if isinstance(m, _TMeta):
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != m.shape or v.stride() != m.stride \
                    or v.dtype != m.dtype:
                got = (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                raise RuntimeError(f"lower_regions: region {r.index} input {a.name} is {got}, compiled for "
                                   f"{(m.shape, m.stride, m.dtype)}")


def lower_regions(gm: fx.GraphModule, *, backend: str = "inductor", cache: RegionCache | None = None,
                  lift_params: bool = True, min_fusible: int = 2) -> LoweredGraph:
    """Split ``gm`` at its memory nodes and compile each distinct compute region once."""
    return LoweredGraph(gm, backend=backend, cache=cache, lift_params=lift_params, min_fusible=min_fusible)


# ====================================================================== whole graph (experimental)
_MM_FAMILY = ("mm", "addmm", "bmm", "baddbmm")


def _is_library_call(func: Any) -> bool:
    """Matmul / attention calls: library kernels both eager and Inductor make (position markers)."""
    base = (getattr(func, "__name__", "") or "").split(".")[0]
    return base in _MM_FAMILY or base.startswith("_scaled_dot_product")


class _MemOpRecorder(TorchDispatchMode):
    """Logs each memory-op call (with how many library calls came before it)."""

    def __init__(self, inputs: Sequence[Any]):
        super().__init__()
        self.ptrs = {}
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor):
                self.ptrs.setdefault((t.data_ptr(), t.numel()), i)
        self.calls: list[tuple[str, tuple, int]] = []
        self.library_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MEMORY_OPS:
            sig = []
            for a in args:
                if isinstance(a, torch.Tensor):
                    sig.append(("in", self.ptrs.get((a.data_ptr(), a.numel()), None)))
                else:
                    sig.append(("c", a))
            self.calls.append((func.__name__.split(".")[0], tuple(sig), self.library_calls))
        elif _is_library_call(func):
            self.library_calls += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class WholeGraphReport:
    memory_nodes: int            # memory nodes in the scheduled graph
    executed: int                # memory-op calls made by the compiled code
    matched: int                 # calls matched to a graph memory node
    on_buffers: int              # calls that touched the real slot/host buffers (not an Inductor copy)
    in_order: int                # matched calls forming the longest run in graph order (LIS)
    same_position: int           # matched calls with as many matmul/attention calls before them as in eager
    loss_rel_err: float
    hosts_max_err: float         # host chunks after the run (what the optimizer reads): compiled vs eager
    slots_max_err: float         # device slots after the run (free at the end: contents do not matter)
    reorder_for_peak_memory: bool
    compile_s: float

    def summary(self) -> str:
        return (f"lower_whole(reorder_for_peak_memory={self.reorder_for_peak_memory}): "
                f"{self.executed}/{self.memory_nodes} memory ops executed, {self.on_buffers} on the real buffers, "
                f"{self.in_order} in graph order, {self.same_position} at their eager position; loss rel err "
                f"{self.loss_rel_err:.1e}, host chunks max err {self.hosts_max_err:.1e}, slots "
                f"{self.slots_max_err:.1e}; compiled in {self.compile_s:.1f} s")


class WholeGraph:
    """The whole scheduled graph compiled by Inductor with the memory ops inside (experimental:
    see the module docstring for what Inductor does to them). Memory ops run their own
    implementations (plain copies), not the engine's accounting."""

    def __init__(self, gm: fx.GraphModule, *, reorder_for_peak_memory: bool = True):
        self.gm = gm
        self.reorder_for_peak_memory = reorder_for_peak_memory
        self._fn: Callable | None = None
        self.compile_s = 0.0

    def _compile(self, inputs: Sequence[Any]) -> Callable:
        if self._fn is None:
            from torch._inductor.compile_fx import compile_fx
            gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
            patches = dict(INDUCTOR_PATCHES, reorder_for_peak_memory=self.reorder_for_peak_memory,
                           force_disable_caches=True)       # caches miss has_side_effect changes
            t0 = time.perf_counter()
            examples = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            self._fn = compile_fx(gm, examples, config_patches=patches)
            self.compile_s = time.perf_counter() - t0
        return self._fn

    def run(self, inputs: Sequence[Any]) -> tuple:
        fn = self._compile(inputs)
        out = fn(*inputs)
        return tuple(out)

    def compare(self, inputs: Sequence[Any], *, seed: int = 0) -> WholeGraphReport:
        """Run eagerly and compiled on copies of ``inputs``; match the memory ops."""
        self._compile(inputs)
        mem_nodes = [n for n in self.gm.graph.nodes if is_memory_node(n)]
        eager_in = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        comp_in = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
        torch.manual_seed(seed)
        with _MemOpRecorder(eager_in) as rec_e:
            (ref,) = self.gm(*eager_in)[:1]
        torch.manual_seed(seed)
        with _MemOpRecorder(comp_in) as rec_c:
            (out,) = self.run(comp_in)[:1]
        assert len(rec_e.calls) == len(mem_nodes), (len(rec_e.calls), len(mem_nodes))
        # match compiled calls to graph memory nodes: k-th occurrence of a signature <-> k-th in eager
        by_sig: dict[tuple, list[int]] = {}
        loose: dict[tuple, list[int]] = {}
        for i, (kind, sig, _) in enumerate(rec_e.calls):
            by_sig.setdefault((kind, sig), []).append(i)
            loose.setdefault((kind, tuple(s for s in sig if s[0] == "c")), []).append(i)
        used: set[int] = set()
        order: list[int] = []
        same_pos = on_buf = 0
        for kind, sig, libs in rec_c.calls:
            if all(s[1] is not None for s in sig if s[0] == "in"):
                on_buf += 1
            cands = by_sig.get((kind, sig)) or loose.get((kind, tuple(s for s in sig if s[0] == "c")), [])
            j = next((c for c in cands if c not in used), None)
            if j is None:
                continue
            used.add(j)
            order.append(j)
            if rec_e.calls[j][2] == libs:
                same_pos += 1
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]

        def err(key: str) -> float:
            idx = [i for i, n in enumerate(phs) if gmeta.get(n, key) is not None]
            return max([(eager_in[i].float() - comp_in[i].float()).abs().max().item() for i in idx] or [0.0])
        rel = abs(float(ref) - float(out)) / max(abs(float(ref)), 1e-30)
        return WholeGraphReport(memory_nodes=len(mem_nodes), executed=len(rec_c.calls), matched=len(order),
                                on_buffers=on_buf, in_order=_lis(order), same_position=same_pos,
                                loss_rel_err=rel, hosts_max_err=err("host_chunk"), slots_max_err=err("slot"),
                                reorder_for_peak_memory=self.reorder_for_peak_memory, compile_s=self.compile_s)


def _lis(seq: Sequence[int]) -> int:
    """Length of the longest increasing subsequence."""
    tails: list[int] = []
    for x in seq:
        k = bisect.bisect_left(tails, x)
        if k == len(tails):
            tails.append(x)
        else:
            tails[k] = x
    return len(tails)


def lower_whole(gm: fx.GraphModule, *, reorder_for_peak_memory: bool = True) -> WholeGraph:
    """Experimental: compile the whole scheduled graph, memory ops included (compiled on first run)."""
    return WholeGraph(gm, reorder_for_peak_memory=reorder_for_peak_memory)
