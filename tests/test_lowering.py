"""The executor: the scheduled graph run node by node or split at memory nodes into eager regions
(compiled eager). One compiled program per schedule (Inductor) is tests/test_program.py."""

from __future__ import annotations

import functools

import torch
from torch import fx

import pscompile
from pscompile.graph import meta as gmeta
from pscompile.compiled.executor import Executor
from pscompile.graph.ops import folds_into_region, is_memory_node
from pscompile.memory.tracker import NonModelTracker
from conftest import make_batches, make_model

aten = torch.ops.aten


def _config(device_memory):
    return pscompile.Config(mode="compiled", backend="eager", device="cpu", dtype=torch.float32,
                            device_memory=device_memory)


@functools.lru_cache(maxsize=None)
def tight_budget(n_layer: int) -> int:
    """The smallest budget compile accepts (bisection on 64 KiB), plus two 64 KiB steps."""
    b = make_batches("gpt", 1)[0]
    lo, hi = 1 << 20, 64 << 20
    while hi - lo > 64 << 10:
        mid = (lo + hi) // 2
        try:
            pscompile.compile(make_model("gpt", n_layer=n_layer), b, config=_config(mid)).close()
            hi = mid
        except ValueError:
            lo = mid
    return hi + (128 << 10)


@functools.lru_cache(maxsize=None)
def engine_for(n_layer: int, budget: str, dropout: float = 0.0):
    b = make_batches("gpt", 1)[0]
    device_memory = tight_budget(n_layer) if budget == "tight" else None
    return pscompile.compile(make_model("gpt", n_layer=n_layer, dropout=dropout), b, config=_config(device_memory))


def graph_inputs(engine) -> list[torch.Tensor]:
    """Fresh slot and host buffers in the plan's initial state, then buffers and batch."""
    sched = engine.schedule
    slots = [torch.empty_like(s) for s in engine.moves.slots[:sched.plan.num_slots]]
    for c, k in sched.plan.initial:      # device-homed chunks: the cast of their master
        engine.store.cast_master_into(c, slots[k])
    hosts = [h.clone() for h in engine.store.host_param]
    b = make_batches("gpt", 1)[0]
    return [*slots, *hosts, *[engine._buffer(f) for f in sched.captured.buffer_fqns],
            *sched.captured.flatten_batch(b)]


def tracked_inputs(engine) -> tuple[list[torch.Tensor], NonModelTracker]:
    """Fresh graph inputs and a tracker that counts the batch and buffers, not the slot and host
    buffers (model data)."""
    inputs = graph_inputs(engine)
    model = {t.untyped_storage().data_ptr() for t in inputs[:num_buffers(engine)]}
    tracker = NonModelTracker(torch.device("cpu"), lambda p: p in model, lambda: 0, exact_windows=True)
    for t in inputs[num_buffers(engine):]:
        tracker.add_tensor(t)
    tracker.reset_peaks()
    return inputs, tracker


def perform(node: fx.Node, args: tuple) -> None:
    """run_memory that just runs the op (what the plain graph does)."""
    node.target(*args)


def num_buffers(engine) -> int:
    return engine.schedule.plan.num_slots + engine.layout.num_chunks


# ------------------------------------------------------------------ splitting (eager backend)
def test_eager_split_runs_like_the_graph():
    engine = engine_for(2, "tight")
    gm = engine.schedule.gm
    lg = Executor(gm)
    rep = lg.report
    mem_nodes = [n for n in gm.graph.nodes if is_memory_node(n)]
    assert rep.memory_nodes == len(mem_nodes) > 0
    assert rep.regions > 1
    assert rep.rebuilt_views == 0, "insert_memory_ops rebuilds parameter views right before each reader"
    assert rep.moved_getitems > 0              # a memory node fell between an op and its getitems

    # plain graph, recording the memory nodes' arguments
    ref_in = graph_inputs(engine)
    recorded = []

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if is_memory_node(n):
                recorded.append((n, self.fetch_args_kwargs_from_env(n)[0]))
            return super().run_node(n)
    (ref,) = Recorder(gm).run(*ref_in)

    got_in = graph_inputs(engine)
    slot_storages = {t.untyped_storage().data_ptr() for t in got_in[:num_buffers(engine)]}
    for r in lg.regions:                       # no region hands out a view of a slot/host buffer
        def checked(args, fn=r.fn):
            outs = fn(args)
            for v in outs:
                assert not (isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in slot_storages)
            return outs
        r.fn = checked
    seen = []

    def run_memory(node, args):
        seen.append((node, args))
        perform(node, args)
    (out,) = lg.run(got_in, run_memory)

    assert torch.equal(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(got_in, ref_in))
    assert [n for n, _ in seen] == [n for n, _ in recorded] == mem_nodes
    pos_got = {id(t): i for i, t in enumerate(got_in)}
    pos_ref = {id(t): i for i, t in enumerate(ref_in)}
    for (n, a), (_, b) in zip(seen, recorded):
        assert len(a) == len(b), n
        for x, y in zip(a, b):
            if isinstance(y, torch.Tensor) and id(y) in pos_ref:
                assert pos_got.get(id(x)) == pos_ref[id(y)], n      # the same slot / host buffer
            elif isinstance(y, torch.Tensor):
                assert torch.equal(x, y), n                          # e.g. the gradient of store_grad
            else:
                assert x == y, n


def test_eager_split_frees_like_the_interpreter():
    """Values die after their last use (region inputs inside the region): the non-model peak of the
    lowered run is no higher than fx.Interpreter's."""
    engine = engine_for(2, "tight")
    gm = engine.schedule.gm
    lg = Executor(gm)
    peaks = []
    for runner in ("interpreter", "lowered"):
        inputs, tracker = tracked_inputs(engine)
        with tracker:
            if runner == "interpreter":
                fx.Interpreter(gm, garbage_collect_values=True).run(*inputs)
            else:
                lg.run(inputs, perform)
        peaks.append(tracker.peak_nonmodel)
    assert peaks[1] == peaks[0], peaks


class _Windows:
    """Per node of the captured graph (src_index): the non-model peak while it ran."""

    def __init__(self, tracker):
        self.tracker, self.samples = tracker, {}

    def before(self, n):
        self.tracker.start_window()

    def after(self, n):
        src = gmeta.get(n, "src_index")
        if src is not None and gmeta.get(n, "param") is None:
            self.samples[src] = max(self.samples.get(src, 0), self.tracker.window_peak)


class _MeasuringInterpreter(fx.Interpreter):
    """fx.Interpreter that frees like the executor is meant to (unread values die at once) and
    samples every node's window; memory nodes run their ops."""

    def __init__(self, gm, windows):
        super().__init__(gm, garbage_collect_values=True)
        for n in gm.graph.nodes:
            if not n.users and n.op not in ("output", "placeholder"):
                self.user_to_last_uses.setdefault(n, []).append(n)
        self.windows = windows

    def run_node(self, n):
        if is_memory_node(n) or n.op == "output":
            return super().run_node(n)
        self.windows.before(n)
        out = super().run_node(n)
        self.windows.after(n)
        return out


def test_node_split_measures_like_the_interpreter():
    """split="nodes" (the measuring run) sees the same non-model bytes at every node as an
    fx.Interpreter with garbage collection: values are released at the same moments."""
    engine = engine_for(2, "tight")
    gm = engine.schedule.gm
    ex = Executor(gm, split="nodes")
    samples = []
    for runner in ("interpreter", "nodes"):
        inputs, tracker = tracked_inputs(engine)
        windows = _Windows(tracker)
        with tracker:
            if runner == "interpreter":
                _MeasuringInterpreter(gm, windows).run(*inputs)
            else:
                ex.run(inputs, perform, observer=windows)
        samples.append(windows.samples)
    assert len(samples[0]) > 100 and samples[1] == samples[0]


def test_boundary_samples_cover_every_operator():
    """Steps after measurement run regions without the per-operator dispatch mode: the peak is
    sampled at every executor step (live storages, plus what each region allocates inside, learned
    by the tracker in its executor's first run). Step by step it is at least what the per-operator tracker measures
    on an identical engine, and within the budget; eager regions run the very operators the
    tracker saw, so there the two are equal."""
    budget = tight_budget(2)
    batches = make_batches("gpt", 4)
    engines = [pscompile.compile(make_model("gpt"), batches[0], config=pscompile.Config(
        mode="compiled", backend="eager", device="cpu", dtype=torch.float32, device_memory=budget))
        for _ in range(2)]
    engines[1]._sample_every_op = True
    for i, b in enumerate(batches):
        losses, peaks = [], []
        for e in engines:
            torch.manual_seed(i)
            losses.append(e.step(b))
            peaks.append(e.stats.peak_device_bytes)
        assert losses[0] == losses[1]
        assert peaks[1] <= peaks[0] <= budget, (i, peaks)
        assert peaks[0] == peaks[1], (i, peaks)
    assert all(ex.split == "regions" for ex in engines[0]._executors.values())
    ex = next(iter(engines[0]._executors.values()))     # the stores into slots run inside the regions
    assert sum(len(r.effects) for r in ex.regions) > 0
    assert not any(s.kind == "mem" and folds_into_region(s.node) for s in ex._program)
