"""The whole-graph lowering experiment: what Inductor does to pscompile's memory ops.

``lower_whole(gm)`` compiles a whole scheduled graph, memory ops included (they are
``torch.library`` custom ops with fake implementations; ``drop``/``wait`` are kept by
``has_side_effect``). Three lowerings:

- ``"functional"``: ``compile_fx``, which functionalizes the graph again. A mutating memory op
  becomes ``auto_functionalized``: where Inductor cannot put it back in place it writes a clone of
  the slot, copied back later (memory the plan does not count).
- ``"ordered"`` (the default): the graph is retraced with Inductor's decompositions but *not*
  functionalized (``make_fx``) and given to ``compile_fx_inner``, which tracks the mutations of
  graph inputs itself. One Inductor defect is worked around: a value computed lazily (a pointwise
  Inductor would inline into its users) from a slot before a memory op overwrites that slot, and
  used after it, is realized only after the overwriting op has been emitted, so it reads the new
  bytes. ``order_mutations`` puts a ``pscompile_bench::realize`` barrier before every mutating
  node; its lowering realizes each such value, so its kernel is emitted first. The barrier
  itself emits no code. ``"unordered"`` is the same lowering without the barriers.

``WholeGraph.compare(inputs)`` runs the compiled graph next to the eager graph and records,
through a TorchDispatchMode, the memory ops the compiled code calls (matched to graph nodes by kind
and buffer arguments), whether they ran in graph order and at their place relative to the matmuls,
and every slot and host buffer after the run against eager's. ``WholeGraph.time`` times it.
docs/design.md ("Lowering") says what the findings mean for the product.

This is a bench tool, not part of pscompile:

    python bench/whole_graph.py [--budget tight|unlimited] [--lowering ordered|unordered|functional] [--steps N]
"""

from __future__ import annotations

import argparse
import bisect
import copy
import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from pscompile.compiled.regions import INDUCTOR_PATCHES
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import MEMORY_OPS, is_memory_node

__all__ = ["WholeGraph", "WholeGraphReport", "lower_whole", "order_mutations"]

LOWERINGS = ("ordered", "unordered", "functional")


@torch.library.custom_op("pscompile_bench::realize", mutates_args=())
def realize(values: list[torch.Tensor]) -> None:
    """A barrier: ``values`` exist as buffers from here on (see ``order_mutations``)."""
    return None


@realize.register_fake
def _(values):
    return None


fx.node.has_side_effect(torch.ops.pscompile_bench.realize.default)


def _register_realize_lowering() -> None:
    """Inductor lowers the barrier by realizing its arguments (once per process, for this op only)."""
    from torch._inductor.lowering import lowerings, register_lowering
    if torch.ops.pscompile_bench.realize.default in lowerings:
        return

    @register_lowering(torch.ops.pscompile_bench.realize.default, type_promotion_kind=None)
    def _lower(values):
        for v in values:
            v.realize()
        return None


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, fx.Node):
                out.append(v)
    return out


def _is_view(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None and len(schema.returns) == 1
            and schema.returns[0].alias_info is not None and not schema.returns[0].alias_info.is_write)


def order_mutations(gm: fx.GraphModule) -> int:
    """Before every node that mutates a graph input, a ``realize`` barrier over each value computed
    (not merely viewed) from that input before it and still used after it. Returns how many
    barriers were inserted."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((pos[u] for u in n.users), default=-1) for n in nodes}
    root: dict[fx.Node, frozenset] = {}       # the inputs a pure view chain starts at
    dep: dict[fx.Node, frozenset] = {}        # the inputs a computed value read
    for n in nodes:
        ins = n.all_input_nodes
        if n.op == "placeholder":
            root[n], dep[n] = frozenset([n]), frozenset()
        elif _is_view(n) and ins:
            root[n], dep[n] = root[ins[0]], dep[ins[0]]
        else:
            root[n] = frozenset()
            dep[n] = frozenset().union(*[dep[i] | root[i] for i in ins]) if ins else frozenset()
    barriers = 0
    for m in nodes:
        written = _mutated_args(m)
        if not written:
            continue
        bufs = frozenset().union(*[root[w] for w in written])
        live = [n for n in nodes[:pos[m]] if last_use[n] > pos[m] and dep[n] & bufs
                and n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
        if live:
            with gm.graph.inserting_before(m):
                gm.graph.call_function(torch.ops.pscompile_bench.realize.default, (live,))
            barriers += 1
    gm.recompile()
    return barriers

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
    on_buffers: int              # matched calls on the same slot/host buffers as eager's (not Inductor copies)
    in_order: int                # matched calls forming the longest run in graph order (LIS)
    same_position: int           # matched calls with as many matmul/attention calls before them as in eager
    loss_rel_err: float
    hosts_max_err: float         # host chunks after the run (what the optimizer reads): compiled vs eager
    slots_max_err: float         # device slots after the run (free at the end: contents do not matter)
    reorder_for_peak_memory: bool
    compile_s: float
    lowering: str = "ordered"
    barriers: int = 0            # realize barriers order_mutations inserted ("ordered" only)

    def summary(self) -> str:
        return (f"lower_whole(lowering={self.lowering!r}, reorder_for_peak_memory={self.reorder_for_peak_memory}, "
                f"{self.barriers} barriers): "
                f"{self.executed}/{self.memory_nodes} memory ops executed, {self.on_buffers} on the real buffers, "
                f"{self.in_order} in graph order, {self.same_position} at their eager position; loss rel err "
                f"{self.loss_rel_err:.1e}, host chunks max err {self.hosts_max_err:.1e}, slots "
                f"{self.slots_max_err:.1e}; compiled in {self.compile_s:.1f} s")


class WholeGraph:
    """The whole scheduled graph compiled by Inductor with the memory ops inside (experimental:
    see the module docstring for the three lowerings). Memory ops run their own implementations
    (plain copies, synchronously), not the engine's accounting."""

    def __init__(self, gm: fx.GraphModule, *, lowering: str = "ordered", reorder_for_peak_memory: bool = True):
        if lowering not in LOWERINGS:
            raise ValueError(f"lowering={lowering!r}: expected one of {LOWERINGS}")
        self.gm = gm
        self.lowering = lowering
        self.reorder_for_peak_memory = reorder_for_peak_memory
        self._fn: Callable | None = None
        self.compile_s = 0.0
        self.barriers = 0

    def _compile(self, inputs: Sequence[Any]) -> Callable:
        if self._fn is None:
            gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
            patches = dict(INDUCTOR_PATCHES, reorder_for_peak_memory=self.reorder_for_peak_memory,
                           force_disable_caches=True)       # caches miss has_side_effect changes
            t0 = time.perf_counter()
            examples = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            if self.lowering == "functional":
                from torch._inductor.compile_fx import compile_fx
                self._fn = compile_fx(gm, examples, config_patches=patches)
            else:
                from torch._inductor.compile_fx import compile_fx_inner
                from torch._inductor.decomposition import select_decomp_table
                from torch.fx.experimental.proxy_tensor import make_fx
                _register_realize_lowering()
                traced = make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*examples)
                if self.lowering == "ordered":
                    self.barriers = order_mutations(traced)
                with torch._inductor.config.patch(patches):
                    boxed = compile_fx_inner(traced, examples)
                self._fn = lambda *args: boxed(list(args))
            self.compile_s = time.perf_counter() - t0
        return self._fn

    def time(self, inputs: Sequence[Any], *, steps: int = 20, warmup: int = 3) -> float:
        """Median seconds per run of the compiled graph on ``inputs`` (their contents change: the
        slots and host chunks are written each run)."""
        fn = self._compile(inputs)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            fn(*inputs)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

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
            cands = by_sig.get((kind, sig)) or loose.get((kind, tuple(s for s in sig if s[0] == "c")), [])
            j = next((c for c in cands if c not in used), None)
            if j is None:
                continue
            used.add(j)
            order.append(j)
            if rec_e.calls[j][1] == sig:      # the same slot and host buffers as in eager, not copies
                on_buf += 1
            if rec_e.calls[j][2] == libs:
                same_pos += 1
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]

        def err(key: str) -> float:
            idx = [i for i, n in enumerate(phs) if gmeta.get(n, key) is not None]
            return max([(eager_in[i].float() - comp_in[i].float()).abs().max().item() for i in idx
                        if eager_in[i].numel()] or [0.0])
        rel = abs(float(ref) - float(out)) / max(abs(float(ref)), 1e-30)
        return WholeGraphReport(memory_nodes=len(mem_nodes), executed=len(rec_c.calls), matched=len(order),
                                on_buffers=on_buf, in_order=_lis(order), same_position=same_pos,
                                loss_rel_err=rel, hosts_max_err=err("host_chunk"), slots_max_err=err("slot"),
                                reorder_for_peak_memory=self.reorder_for_peak_memory, compile_s=self.compile_s,
                                lowering=self.lowering, barriers=self.barriers)


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


def lower_whole(gm: fx.GraphModule, *, lowering: str = "ordered", reorder_for_peak_memory: bool = True) -> WholeGraph:
    """Experimental: compile the whole scheduled graph, memory ops included (compiled on first run)."""
    return WholeGraph(gm, lowering=lowering, reorder_for_peak_memory=reorder_for_peak_memory)


def main(argv: list[str] | None = None) -> int:
    import pscompile
    from pscompile.models.gpt import GPT, GPTConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", choices=("tight", "unlimited"), default="tight")
    ap.add_argument("--lowering", choices=LOWERINGS, default="ordered")
    ap.add_argument("--steps", type=int, default=0,
                    help="also time this many runs of the whole graph against the engine's forward + backward "
                         "(compiled regions, same budget); 0: correctness only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64))
    batch = (torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64)))
    probe = pscompile.compile(model, batch, config=pscompile.Config(
        device="cpu", dtype=torch.float32, backend="eager"))
    minimum = probe.min_device_memory
    probe.close()
    budget = minimum + 128 * 1024 if args.budget == "tight" else None
    engine = pscompile.compile(model, batch, config=pscompile.Config(
        device="cpu", device_memory=budget, dtype=torch.float32, backend="eager"))
    engine.step(batch)
    whole = lower_whole(engine.schedule.gm, lowering=args.lowering)
    inputs = graph_inputs(engine, batch)
    report = whole.compare(inputs)
    engine.close()
    print(report.summary())
    ok = (report.executed == report.memory_nodes and report.loss_rel_err <= 1e-5
          and report.hosts_max_err <= 1e-5)
    if args.steps:
        print(timing(whole, inputs, model, batch, budget, steps=args.steps))
    return 0 if ok else 1


def timing(whole: WholeGraph, inputs: Sequence[Any], model, batch, budget, *, steps: int) -> str:
    """The whole graph's median run against the engine's median forward + backward (same model,
    budget and batch; memory ops are copies on this machine's memory in both, no link)."""
    import pscompile
    t_whole = whole.time(inputs, steps=steps)
    rows = [f"whole graph ({whole.lowering}): {t_whole * 1e3:.2f} ms per forward + backward"]
    for backend in ("eager", "inductor"):
        engine = pscompile.compile(model, batch, config=pscompile.Config(
            device="cpu", device_memory=budget, dtype=torch.float32, backend=backend))
        fb = []
        for i in range(steps + 3):
            engine.step(batch)
            st = engine.stats
            if i >= 3:
                fb.append(st.forward_s + st.backward_s)
        engine.close()
        t = statistics.median(fb)
        rows.append(f"engine, {backend} regions: {t * 1e3:.2f} ms per forward + backward "
                    f"(whole graph / this: {t_whole / t:.2f})")
    return "\n".join(rows)


def graph_inputs(engine, batch) -> list[torch.Tensor]:
    """Fresh slot and host buffers in the plan's initial state, then buffers and batch (the
    engine's own buffers stay untouched: the experiment runs the graph twice)."""
    sched = engine.schedule
    slots = [torch.empty_like(s) for s in engine._slots[:sched.plan.num_slots]]
    for c, k in sched.plan.initial:
        slots[k].copy_(engine.store.master[c])      # device-homed: the cast of its master
    hosts = [h.clone() for h in engine.store.host_param]
    return [*slots, *hosts, *[engine.model.get_buffer(f) for f in sched.captured.buffer_fqns],
            *sched.captured.flatten_batch(batch)]


if __name__ == "__main__":
    raise SystemExit(main())
