"""One compiled program per schedule: Inductor compiles the whole scheduled graph, memory nodes inside.

``WholeProgram(gm, device)`` lowers a scheduled graph (``graph/pipeline.py``) in three steps:

1. **Retrace** it with Inductor's decompositions, on fake inputs made from its placeholders'
   metadata, and again **functionalized**: the compute Inductor sees is functional, and only the
   memory nodes mutate. Inductor orders a program by its data flow; an in-place op on an
   intermediate (dropout's ``empty_like(...).bernoulli_(p).div_(1 - p)``) can otherwise be read by
   a kernel scheduled before it ran (a mask read from uninitialized memory: NaN in some processes,
   different losses in the others). The memory nodes stay calls of the ``pscompile::`` ops on the
   real slot and host buffers, with the mutations their schemas declare (their Functionalize
   kernels, ``graph/ops.py``); functionalized like the compute, Inductor would write clones of the
   slots. A mutation of anything else left after that (``compute_mutations``) stops the compile,
   naming the op, and the schedule runs as compiled eager. An op left that Inductor cannot lower
   but torch can decompose is decomposed too (``unlowered_with_decomposition``), never left to a
   fallback kernel.
2. **Pin the order** (``order_edges``) with Inductor's ``control_deps``: each memory node comes after
   the memory node before it and after every value computed before it and still used after it
   (values Inductor would otherwise compute lazily, after a write to the buffer they read), and
   every compute node comes after the memory node before it. The plan's order of
   memory nodes and compute is then the program's, and ``reorder_for_peak_memory`` is off.
3. **Compile** with ``compile_fx_inner`` and read Inductor's own buffer plan off its generated
   wrapper (``compiled/buffer_plan.py``): for each memory node, the bytes Inductor's buffers hold
   at most in the compute before it (``inside``) and while it runs (``at``). The engine checks the
   plan against those figures before the program ever runs (``compiled/lowering.py``).

A range's schedule (batches whose length changes) is compiled once for **symbolic sizes**
(``SymbolicSizes``): the batch's dynamic dimensions are symbols hinted at the range's bound, so
the buffer plan is counted at the bound, and ``buffers_for`` evaluates it at any run's sizes.
Inductor's assumptions about the symbols (its shape guards) are kept; ``admits`` checks them for
each new length before the program runs it.

At run time a memory node is a call of its custom op from the generated code; ``run`` makes those
calls go to the engine (``graph.ops.memory_runner``) in graph order, one by one: the k-th call
must be the k-th memory node, or the run stops with ``ProgramOrderError`` (never seen; it would
mean Inductor moved a memory op). The engine performs each as planned: asynchronous copies start
there and are waited for at their ``wait`` node, bytes are counted, and the samples of the device
peak add Inductor's buffers (``inside``/``at``) to what the tracker sees.
"""

from __future__ import annotations

import logging
import operator
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
from torch import fx

from pscompile.compiled.buffer_plan import BufferPlan, KeepGraph, UnreadWrapperLine, buffer_events, replay
from pscompile.compiled.program_store import Learned, ProgramStore
from pscompile.compiled.regions import is_view_op
from pscompile.graph.ops import memory_runner, runs_as_transfer

log = logging.getLogger("pscompile.compiled")

__all__ = ["WholeProgram", "ProgramOrderError", "ComputeMutationError", "compute_mutations", "order_edges",
           "BufferPlan", "SymbolicSizes"]

# Inductor's options for the program: random ops call ATen in graph order (dropout masks equal
# eager's); the plan's order is kept (no reordering for peak memory, which is the plan's job); no FX
# graph cache (its ordering edges make Inductor bypass it: ``program_store.py`` keeps the program)
PATCHES: dict[str, Any] = {"fallback_random": True, "reorder_for_peak_memory": False,
                           "fx_graph_cache": False}


def _nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    """``aten.nll_loss_backward`` for class scores ``(N, C)`` as one pointwise ``where`` (the
    gradient is ``-grad / total_weight`` at each row's target, zero elsewhere), which Inductor fuses
    into the log-softmax backward that reads it; torch's decomposition scatters into a zeroed
    ``(N, C)`` buffer, which stays live beside the logits (a vocabulary-sized buffer more in the
    loss's kernels). Other forms: torch's own (``NotImplemented``)."""
    if self.dim() != 2 or target.dim() != 1 or reduction not in (0, 1, 2):
        return NotImplemented
    g = grad_output / total_weight if reduction == 1 else grad_output
    if reduction == 0:
        g = g.unsqueeze(1)
    if weight is not None:               # (an ignored target may lie outside the classes: clamped, masked below)
        g = g * weight[target.clamp(0, self.shape[1] - 1)].unsqueeze(1)
    hit = (torch.arange(self.shape[1], device=self.device).unsqueeze(0) == target.unsqueeze(1)) & \
        (target != ignore_index).unsqueeze(1)
    return torch.where(hit, -g, torch.zeros((), dtype=self.dtype, device=self.device))


def _constant_pad_nd(self, pad, value=0):
    """``aten.constant_pad_nd`` with pads of zero or more as concatenations of constant blocks.
    Torch's own specializes a symbolic size it pads (a guard ``Eq(s, its hint)``: the range's
    program would serve one length), as in Hugging Face's causal-LM loss, which shifts its labels
    with ``pad(labels, (0, 1), value=-100)``. Negative pads (a crop): torch's (``NotImplemented``)."""
    if any(not isinstance(p, int) or p < 0 for p in pad):
        return NotImplemented
    out = self
    for k in range(len(pad) // 2):
        dim = self.dim() - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        parts = []
        for n in (before, after):
            shape = list(out.shape)
            shape[dim] = n
            parts.append(torch.full(shape, value, dtype=self.dtype, device=self.device))
        out = torch.cat([parts[0], out, parts[1]], dim) if before or after else out
    return out if out is not self else self.clone()


PROGRAM_DECOMPOSITIONS = {torch.ops.aten.nll_loss_backward.default: _nll_loss_backward,
                          torch.ops.aten.constant_pad_nd.default: _constant_pad_nd}


# how many rounds ``compile`` retraces (functionalized, decomposed) until no op is left that mutates or
# that Inductor has no lowering for (a round can only expose ops that the one before emitted)
_RETRACES = 4


def unlowered_with_decomposition(gm: fx.GraphModule) -> dict:
    """Decompositions for the ops of ``gm`` that Inductor has no lowering for but torch can decompose.

    Inductor would run such an op as an implicit fallback kernel, and refuses to when the ``CI``
    environment variable is set (``make_fallback``: "a decomposition exists, we should switch to
    it"). Random ops stay ATen calls, as ``fallback_random`` wants (their masks equal eager's)."""
    from torch._decomp import get_decompositions
    from torch._decomp.decompositions_for_rng import extra_random_decomps
    from torch._inductor.lowering import FALLBACK_ALLOW_LIST, lowerings
    found = {}
    for n in gm.graph.nodes:
        t = n.target
        if (n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t in lowerings
                or t in extra_random_decomps or t.name().split(".")[0] in FALLBACK_ALLOW_LIST):
            continue
        found.update(get_decompositions([t]))
    return found


class ProgramOrderError(RuntimeError):
    """The compiled program called a memory op out of the schedule's order."""


class ComputeMutationError(RuntimeError):
    """The program's compute still mutates a tensor after functionalization (the op is named)."""


def compute_mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` that mutate a tensor and are not memory nodes. Functionalization's
    write-back of a mutated graph input (``aten.copy_`` into a placeholder) is an ordinary input
    mutation to Inductor, ordered after every read of that input, and is not counted."""
    found = []
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or runs_as_transfer(n) or schema is None or not schema.is_mutable:
            continue
        if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
            continue
        found.append(n)
    return found


def _retrace(gm: fx.GraphModule, table: dict, mode, examples: list) -> fx.GraphModule:
    """``gm`` functionalized (see the module doc) and traced with the decompositions ``table``.
    A decomposition runs below functionalization, so what it emits in place, and a functional op
    that only functionalization exposed (``clamp_`` becomes ``clamp``, which Inductor decomposes),
    are handled by the next round of ``WholeProgram.compile``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    with mode:
        return make_fx(torch.func.functionalize(gm, remove="mutations"), decomposition_table=table,
                       tracing_mode="real")(*examples)


@contextmanager
def deterministic_lowering():
    """Inductor lowers as under ``torch.use_deterministic_algorithms(True)`` (restored after): an
    accumulating scatter (the embedding's backward, ``index_put_(..., accumulate=True)``) becomes
    ATen's kernel, which adds in a fixed order, instead of atomic adds, whose order changes from run
    to run with more than one thread. The same seeds then give the same weights in every process.
    Only the lowering is affected; what runs later runs with the process's own setting. The setting
    is the process's, so threads running meanwhile (copies, early updates) see it too; filling new
    buffers with NaN, which it would also turn on, stays as it was (it would only slow them)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = fill and was
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _is_view(n: fx.Node) -> bool:
    """A node Inductor lowers to a view of its input (a getitem, a view op): no kernel, so no place
    in the order of its own."""
    return n.op == "call_function" and (n.target is operator.getitem or is_view_op(n))


def order_edges(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The ordering edges ``control_deps`` adds (see the module doc): node -> nodes it must follow.
    Views make no kernel, so they are seen through: a value read through a view is read where the
    view is read. Every compute node is pinned after the last memory node before it: a pin on a
    value Inductor computes lazily (inside its readers' kernels) makes no kernel of its own to
    order, so its readers need theirs (a reader of a slot could otherwise run before the ``wait``
    for that slot's fetch)."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_use: dict[fx.Node, int] = {}
    for n in reversed(nodes):          # a view's uses are its base's
        last_use[n] = max((last_use[u] if _is_view(u) else pos[u] for u in n.users), default=-1)
    computed = lambda n: (n.op == "call_function" and not runs_as_transfer(n) and not _is_view(n)  # noqa: E731
                          and isinstance(n.meta.get("val"), (torch.Tensor, tuple, list)))
    edges: dict[fx.Node, list[fx.Node]] = {}
    prev: fx.Node | None = None
    live: list[fx.Node] = []          # computed values so far (pruned as they die)
    for n in nodes:
        if runs_as_transfer(n):
            live = [v for v in live if last_use[v] > pos[n]]
            deps = ([prev] if prev is not None else []) + [v for v in live if v not in n.all_input_nodes]
            if deps:
                edges[n] = deps
            prev = n
        elif computed(n):
            if prev is not None:       # every one: a lazy value's own edge is lost (control_deps does
                edges[n] = [prev]      # not realize it), so its readers carry one too
            live.append(n)
    return edges


def _pin(gm: fx.GraphModule, edges_of: Callable[[fx.GraphModule], dict]) -> int:
    """Apply ``edges_of(gm)`` with ``preserve_node_ordering``; returns how many nodes were pinned."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet
    edges = edges_of(gm)
    edges = {n: OrderedSet(d) for n, d in edges.items() if d}
    preserve_node_ordering(gm.graph, edges)
    gm.recompile()
    return len(edges)


@dataclass(frozen=True)
class SymbolicSizes:
    """The sizes a range's program takes as symbols: ``dims`` lists (placeholder index, dimension,
    symbol index) for each dynamic size of the scheduled graph's inputs (dimensions that share a
    symbol in the capture share one here), and ``hints[i]`` is symbol i's value at the range's
    bound, the sizes Inductor's buffer plan is counted at."""

    dims: tuple[tuple[int, int, int], ...]
    hints: tuple[int, ...]

    def values(self, inputs: Sequence[torch.Tensor], symbols: Sequence[sympy.Symbol]) -> dict:
        """Each symbol's value in ``inputs`` (the graph's inputs of one run)."""
        return {symbols[k]: int(inputs[p].shape[d]) for p, d, k in self.dims}


def _literal_ints(gm: fx.GraphModule) -> set[int]:
    """The integers written in ``gm``'s code (sizes, dims), to keep a symbol's hint off them."""
    found: set[int] = set()

    def visit(a) -> None:
        if isinstance(a, int) and not isinstance(a, bool):
            found.add(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
    for n in gm.graph.nodes:
        visit(n.args)
        visit(tuple(n.kwargs.values()))
    return found


def _examples(gm: fx.GraphModule, device: torch.device, sizes: SymbolicSizes | None = None):
    """Fake tensors with the placeholders' shapes, strides and dtypes (their metadata); with
    ``sizes``, the dimensions it names are symbols (such an input is taken contiguous, as a batch
    is), hinted at the bound or just above it, off every integer in the code and each other: a
    hint only guides Inductor's choices, and one equal to a constant size would make it specialize
    the symbol to it. Returns the fake mode, the inputs and the symbols."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    symbols, symints = [], []
    taken = _literal_ints(gm) if sizes is not None else set()
    for k, hint in enumerate(sizes.hints if sizes is not None else ()):
        while hint in taken:        # a hint equal to a size in the code (a head's width) lets Inductor
            hint += 1               # take the two for one: Eq(s, 32), the symbol specialized
        taken.add(hint)
        src = ConstantSource(f"pscompile_size{k}")
        sym = env.create_symbol(hint, src, dynamic_dim=DimDynamic.DYNAMIC)
        symbols.append(sym)
        symints.append(env.create_symintnode(sym, hint=hint, source=src))
    dynamic: dict[int, dict[int, Any]] = {}
    for p, d, k in sizes.dims if sizes is not None else ():
        dynamic.setdefault(p, {})[d] = symints[k]
    out = []
    with mode:
        for i, p in enumerate(gm.graph.find_nodes(op="placeholder")):
            v = p.meta.get("val")
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"placeholder {p.name} has no tensor metadata")
            dev = device if v.device.type == "meta" else v.device
            if i in dynamic:
                shape = [dynamic[i].get(d, s) for d, s in enumerate(v.shape)]
                out.append(torch.empty(shape, dtype=v.dtype, device=dev))
            else:
                out.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=dev))
    return mode, out, symbols


class WholeProgram:
    """The scheduled graph ``gm`` compiled as one Inductor program (see the module doc).

    ``compile()`` lowers it (raises what Inductor raised), its order pinned by ``edges``
    (``order_edges``); ``buffers`` is Inductor's buffer plan (None if it could not be read);
    ``run(inputs, run_memory)`` runs it, each memory node through ``run_memory(node, args)``, in
    graph order."""

    split = "program"

    def __init__(self, gm: fx.GraphModule, device: torch.device,
                 edges: Callable[[fx.GraphModule], dict[fx.Node, list[fx.Node]]] = None,
                 sizes: SymbolicSizes | None = None, store: ProgramStore | None = None):
        self.gm = gm
        self.store = store if store is not None else ProgramStore()
        self.cache_hit = False                   # its code came from the store (``compile``)
        self.key: str | None = None              # its key there
        self.sizes = sizes                       # a range's program: these sizes are symbols
        self._symbols: list[sympy.Symbol] = []
        self._guards: list[sympy.Expr] = []      # what Inductor assumed of the symbols
        self._events: list[tuple] = []           # its buffer plan, for any sizes (``buffers_for``)
        self._plans: dict[tuple, BufferPlan] = {}
        self.edges = edges or order_edges        # (tests drop some, to see parity break)
        self.device = torch.device(device)
        self.memory_nodes = [n for n in gm.graph.nodes if runs_as_transfer(n)]
        self.ops = sum(1 for n in gm.graph.nodes if n.op == "call_function" and not runs_as_transfer(n))
        self.buffers: BufferPlan | None = None
        self.compile_s = 0.0
        self.pinned = 0
        self._fn: Callable[[list], Sequence[Any]] | None = None
        from pscompile.compiled.steps import first_backward
        first_bwd = first_backward(list(gm.graph.nodes))
        pos = {n: i for i, n in enumerate(gm.graph.nodes)}
        at = pos.get(first_bwd, len(pos))
        self._first_bwd_op = next((k for k, n in enumerate(self.memory_nodes) if pos[n] > at), None)

    def compile(self) -> None:
        """Lower the program (see the class doc), or load it from the ``store`` where a process
        lowered the same graph before (its buffer plan and guards with it)."""
        from torch._inductor.compile_fx import compile_fx_inner
        t0 = time.perf_counter()
        mode, examples, self._symbols = _examples(self.gm, self.device, self.sizes)
        # (the key is the scheduled graph's: what it is traced and pinned into follows from it, the
        # decompositions and the edges; only the default edges' programs are kept)
        key = self.key = self.store.key(self.gm, examples, self._symbols, self.device) \
            if self.edges is order_edges else None
        with torch._guards.tracing(torch._guards.TracingContext(mode)), mode:
            found = self.store.load(key, self.gm, examples, self._symbols) if key else None
        if found is not None:
            self._fn, learned = found
            self.cache_hit = True
            self._events, self._guards, self.pinned = list(learned.events), list(learned.guards), learned.pinned
        else:
            traced = self._traced(mode, examples)
            self.pinned = _pin(traced, self.edges)
            keep = KeepGraph()
            with torch._inductor.config.patch({**PATCHES, "_post_fusion_custom_pass": keep}), \
                    torch._guards.tracing(torch._guards.TracingContext(mode)), mode, deterministic_lowering():
                self._fn = compile_fx_inner(traced, examples)
            env = mode.shape_env
            self._guards = [g.expr for g in env.guards] + [a.expr for asserts in env.deferred_runtime_asserts.values()
                                                           for a in asserts]
            try:
                self._events = buffer_events(keep.graph)
            except UnreadWrapperLine as e:     # a torch whose wrapper pscompile does not read: say so
                log.warning("pscompile: %s; the schedule runs as compiled eager", e)
                self.compile_s = time.perf_counter() - t0
                return
            except Exception as e:  # noqa: BLE001 - no plan: the engine runs the schedule as compiled eager
                log.warning("pscompile: Inductor's buffer plan could not be read (%s: %s); the schedule runs as "
                            "compiled eager", type(e).__name__, e)
                self.compile_s = time.perf_counter() - t0
                return
            if key:
                with torch._guards.tracing(torch._guards.TracingContext(mode)), mode:
                    self.store.save(key, self._fn, examples, self._symbols,
                                    Learned(tuple(self._events), tuple(self._guards), self.pinned))
        try:
            self.buffers = replay(self._events, self._hints())
        except Exception as e:  # noqa: BLE001 - no plan: the engine runs the schedule as compiled eager
            log.warning("pscompile: Inductor's buffer plan could not be read (%s: %s); the schedule runs as "
                        "compiled eager", type(e).__name__, e)
        self.compile_s = time.perf_counter() - t0

    def _traced(self, mode, examples: list) -> fx.GraphModule:
        """The graph functionalized and decomposed until Inductor lowers every op (``_RETRACES``)."""
        from torch._inductor.decomposition import select_decomp_table
        with torch._inductor.config.patch(PATCHES):     # (fallback_random: random ops are not decomposed)
            table = {**select_decomp_table(), **PROGRAM_DECOMPOSITIONS}
        traced = self.gm
        for _ in range(_RETRACES):
            traced = _retrace(traced, table, mode, examples)
            more = unlowered_with_decomposition(traced)
            mutating = compute_mutations(traced)
            if not more and not mutating:
                break
            if more:
                log.info("pscompile: decomposed for Inductor (no lowering): %s", sorted(map(str, more)))
            table.update(more)
        if mutating:
            raise ComputeMutationError(
                f"the compute still mutates after functionalization: {mutating[0].format_node()} "
                f"({len(mutating)} such nodes); Inductor's order of it cannot be trusted")
        return traced

    def _hints(self) -> dict:
        return dict(zip(self._symbols, self.sizes.hints)) if self.sizes is not None else {}

    def size_values(self, inputs: Sequence[torch.Tensor]) -> dict:
        """A range's program: each size symbol's value in ``inputs`` (empty for fixed sizes)."""
        return self.sizes.values(inputs, self._symbols) if self.sizes is not None else {}

    def admits(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether the program runs ``inputs``' sizes: a fixed program, always (the engine keys it
        by its sizes); a range's, when every assumption Inductor made of its symbols while
        compiling (its shape guards) holds for them."""
        if self.sizes is None:
            return True
        values = self.sizes.values(inputs, self._symbols)
        return all(bool(sympy.sympify(g).xreplace(values)) for g in self._guards)

    def buffers_for(self, inputs: Sequence[torch.Tensor]) -> BufferPlan | None:
        """Inductor's buffer plan at ``inputs``' sizes (a fixed program: ``buffers``)."""
        if self.sizes is None or self.buffers is None:
            return self.buffers
        values = self.sizes.values(inputs, self._symbols)
        key = tuple(values[s] for s in self._symbols)
        if key not in self._plans:
            self._plans[key] = replay(self._events, values)
        return self._plans[key]

    def run(self, inputs: Sequence[torch.Tensor], run_memory: Callable[[fx.Node, tuple], Any], *,
            sample: Callable[[int], None] | None = None, on_backward: Callable[[], None] | None = None) -> tuple:
        """Run the program; memory node k is ``run_memory(node_k, its args)``. ``sample(extra)``
        is called before and after each with Inductor's buffer bytes there (``BufferPlan``), and
        ``on_backward()`` at the first memory node of the backward."""
        if self._fn is None:
            self.compile()
        nodes, first_bwd = self.memory_nodes, self._first_bwd_op
        plan = self.buffers_for(inputs) if sample else None
        inside, at = (plan.inside, plan.at) if plan is not None else ((), ())
        k = 0

        def call(op, args: tuple):
            nonlocal k
            if k >= len(nodes) or nodes[k].target is not op:
                want = nodes[k].format_node() if k < len(nodes) else "none"
                raise ProgramOrderError(f"the compiled program called {op} as memory op {k}; the schedule "
                                        f"has {want} there")
            n = nodes[k]
            if k == first_bwd and on_backward is not None:
                on_backward()
            if inside:
                sample(inside[k])
            k += 1
            made = run_memory(n, args)
            if at:
                sample(at[k - 1])
            return made

        with memory_runner(call):
            out = self._fn(list(inputs))
        if inside:
            sample(plan.after)
        if k != len(nodes):
            raise ProgramOrderError(f"the compiled program called {k} of the schedule's {len(nodes)} memory ops")
        return tuple(out)
