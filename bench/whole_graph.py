"""The whole-graph lowering experiment: what Inductor does to pscompile's memory ops.

``lower_whole(gm)`` compiles a whole scheduled graph, memory ops included (they are
``torch.library`` custom ops with fake implementations; ``drop``/``wait`` are kept by
``has_side_effect``). ``WholeGraph.compare(inputs)`` runs it next to the eager graph and records,
through a TorchDispatchMode, the memory ops the compiled code calls (matched to graph nodes by kind
and buffer arguments), whether they ran in graph order, at their place relative to the matmuls,
and on the real slot/host buffers or on copies. The findings (docs/design.md, "Lowering") are why
the product keeps memory ops in its executor and compiles only the regions between them.

This is a bench tool, not part of pscompile:

    python bench/whole_graph.py [--budget tight|unlimited]
"""

from __future__ import annotations

import argparse
import bisect
import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from pscompile.compiled.regions import INDUCTOR_PATCHES
from pscompile.graph import meta as gmeta
from pscompile.graph.ops import MEMORY_OPS, is_memory_node

__all__ = ["WholeGraph", "WholeGraphReport", "lower_whole"]

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


def main(argv: list[str] | None = None) -> int:
    import pscompile
    from pscompile.models.gpt import GPT, GPTConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", choices=("tight", "unlimited"), default="tight")
    args = ap.parse_args(argv)
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
    report = lower_whole(engine.schedule.gm).compare(graph_inputs(engine, batch))
    print(report.summary())
    ok = report.executed == report.memory_nodes and report.loss_rel_err <= 1e-5
    return 0 if ok else 1


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
