"""Compiled regions are checked and measured on the inputs they really receive (compiled/probe.py).

- a region that gathers at positions computed from values an earlier region made trains through
  Inductor under an evicting budget (made-up inputs make those positions NaN, out of range);
- a region Inductor fails to compile, one that raises when measured on its real inputs, and one
  given inputs of another layout run as eager graph code, with a ``pscompile`` warning naming the
  region and its source line, and training goes on tracking plain PyTorch;
- ``layout_mismatch`` names the node whose strides, dtype or storage differ from what the region
  was compiled for.

The whole suite runs with ``TensorMeta.example()`` raising (conftest.py): no region is compiled,
run or measured on made-up values.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

import pscompile
from pscompile.compiled import program as program_module
from pscompile.compiled import probe as probe_module
from pscompile.compiled.regions import Region, TensorMeta, layout_mismatch, written_inputs
from pscompile.testing import ReferenceTrainer, routed_gather
from conftest import make_batches, make_model, max_weight_diff

aten = torch.ops.aten
HP = pscompile.AdamW(lr=1e-3)


def _routed():
    return routed_gather()


def _config(budget=None) -> pscompile.Config:
    return pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32,
                            device_memory=budget)


def _train_against_plain(make, budget, steps: int = 4):
    """(engine, losses, plain losses) after ``steps`` steps; every step within the budget, moving
    what it planned."""
    model, batch = make()
    ref = ReferenceTrainer(make()[0], optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(model, batch, optimizer=HP, config=_config(budget))
    ours, plain = [], []
    for _ in range(steps):
        ours.append(engine.step(batch))
        plain.append(ref.step(batch))
        s = engine.stats
        assert budget is None or s.peak_device_bytes <= budget, (s.peak_device_bytes, budget)
        assert (s.chunk_h2d_bytes, s.chunk_d2h_bytes) == (engine.last_plan.h2d_bytes, engine.last_plan.d2h_bytes)
    for a, b in zip(ours, plain):
        assert abs(a - b) <= 1e-5 * abs(b), (ours, plain)
    assert max_weight_diff(engine, ref) <= 1e-5
    return engine


def _region_executors(engine):
    return [ex for ex in engine._executors.values() if ex.split == "regions"]


def test_positions_computed_in_another_region_index_in_range():
    model, batch = _routed()
    budget = int(pscompile.min_device_memory(model, batch, _config()) * 1.5)   # room for its regions' peaks
    engine = _train_against_plain(_routed, budget)
    assert engine.stats.num_evictions > 0
    (ex, *_) = _region_executors(engine)
    div = next(n for n in ex.gm.graph.nodes if n.target is aten.div.Tensor)
    gather = next(n for n in ex.gm.graph.nodes if n.target is aten.gather.default)
    r = next(r for r in ex.regions if gather in r.nodes)
    # the premise: the division's operands come from another region, and the positions it gives
    # are gathered with in a compiled region (the division's, or one cut from it to fit the budget)
    assert set(div.all_input_nodes) <= set(next(q for q in ex.regions if div in q.nodes).inputs), ex.describe()
    assert ex.is_compiled(r), ex.describe()
    assert r.key in engine._allocs and engine._allocs[r.key].peak > 0
    assert not engine._region_cache.failures("inductor")       # measured, not fallen back
    engine.close()


def _gpt():
    return make_model("gpt"), make_batches("gpt", 1)[0]


def _tight_gpt() -> int:
    return int(pscompile.min_device_memory(*_gpt(), _config()) * 1.3)


def _warnings(caplog) -> list[str]:
    """The fall-back warnings (a region cut to fit the budget warns of its own)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("pscompile") and r.levelno == logging.WARNING
            and "runs as eager code from now on" in r.getMessage()]


def _first_layer_norm_region(graph: fx.Graph) -> bool:
    return any(n.target is aten.native_layer_norm.default for n in graph.nodes)


def test_a_region_inductor_cannot_compile_runs_as_eager_code(monkeypatch, caplog):
    real, failed = program_module.compile_inductor, []

    def compile_or_fail(graph, metas):
        if not failed and _first_layer_norm_region(graph):
            failed.append(graph)
            raise RuntimeError("injected compiler failure")
        return real(graph, metas)
    monkeypatch.setattr(program_module, "compile_inductor", compile_or_fail)
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        engine = _train_against_plain(_gpt, _tight_gpt())
    (message,) = _warnings(caplog)
    assert "compiling failed: RuntimeError: injected compiler failure" in message
    assert "gpt.py:" in message                  # the model's source line
    ex = _region_executors(engine)[-1]
    assert ex.report.fallbacks >= 1 and ex.report.compiled > ex.report.fallbacks
    assert all("injected compiler failure" in r.fallback for r in ex.regions if r.fallback)
    engine.close()


def test_a_region_that_fails_on_its_real_inputs_runs_as_eager_code(monkeypatch, caplog):
    real, broken = program_module.compile_inductor, []

    def compile_broken(graph, metas):
        fn = real(graph, metas)
        if broken or not _first_layer_norm_region(graph):
            return fn

        def kernel_fails(args):
            args.clear()
            raise RuntimeError("injected kernel failure")
        broken.append(graph)
        return kernel_fails
    monkeypatch.setattr(program_module, "compile_inductor", compile_broken)
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        engine = _train_against_plain(_gpt, _tight_gpt())   # would raise if the broken code ran in a step
    (message,) = _warnings(caplog)
    assert "running it on its real inputs failed: RuntimeError: injected kernel failure" in message
    assert "gpt.py:" in message
    ex = _region_executors(engine)[-1]
    assert ex.report.compiled > 0 and any(r.fallback for r in ex.regions)
    engine.close()


def test_a_region_given_another_layout_runs_as_eager_code(monkeypatch, caplog):
    """What a region receives is checked against what it was compiled for in its executor's first
    run; a mismatch (here made to appear for one region) is never run compiled."""
    real, hit = probe_module.layout_mismatch, []

    def mismatch_once(r, args):
        if not hit and _first_layer_norm_region(r.graph):
            hit.append(r.key)
            return f"region {r.index} receives node {r.inputs[0].name} as stride (1,), compiled for (64,)"
        return real(r, args)
    monkeypatch.setattr(probe_module, "layout_mismatch", mismatch_once)
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        engine = _train_against_plain(_gpt, _tight_gpt())
    (message,) = _warnings(caplog)
    assert "checking its inputs' layout failed" in message and "compiled for (64,)" in message
    assert all(r.fallback for ex in _region_executors(engine) for r in ex.regions if r.key in hit)
    engine.close()


def test_the_first_compiled_run_checks_layouts_too(monkeypatch, caplog):
    """A compiled region's outputs may have other strides than its eager code's (Phi-3's attention
    received a transposed view where the probing run, all eager code, had passed a contiguous
    tensor, and Inductor's stride assertion ended the step): the first compiled run of every
    executor checks each compiled region's inputs again, and a region given another layout there
    runs as eager code (here the mismatch is made to appear in that run only)."""
    import inspect
    real, hit = probe_module.layout_mismatch, []

    def mismatch_when_compiled(r, args):
        caller = inspect.currentframe().f_back.f_locals.get("self")
        if isinstance(caller, probe_module.Probe) and not caller.eager_all and not hit \
                and _first_layer_norm_region(r.graph):
            hit.append(r.key)
            return f"region {r.index} receives node {r.inputs[0].name} as stride (1,), compiled for (64,)"
        return real(r, args)
    monkeypatch.setattr(probe_module, "layout_mismatch", mismatch_when_compiled)
    with caplog.at_level(logging.WARNING, logger="pscompile"):
        engine = _train_against_plain(_gpt, _tight_gpt(), steps=5)
    assert hit, "no compiled run checked its regions' inputs"
    (message,) = _warnings(caplog)
    assert "checking its inputs' layout failed" in message and "compiled for (64,)" in message
    assert all(r.fallback for ex in _region_executors(engine) for r in ex.regions if r.key in hit)
    engine.close()


def test_a_region_too_large_to_measure_within_the_budget_is_cut_not_measured(monkeypatch):
    """Measuring a region holds copies of its inputs beside the chunks on the device: where that and
    the most its code can allocate would not fit the budget (Mixtral's stacked experts at its
    minimum: the probing step went 4.5% over), the region is not measured but cut like one that
    does not fit the plan (here the first layer-norm region is made to look too large)."""
    from pscompile.compiled import lowering
    real, big = lowering.made_bytes, []

    def made_bytes(r):
        if _first_layer_norm_region(r.graph) and not big:
            big.append(r.key)
        return 1 << 40 if r.key in big else real(r)
    monkeypatch.setattr(lowering, "made_bytes", made_bytes)
    engine = _train_against_plain(_gpt, _tight_gpt(), steps=5)
    assert big and big[0] in engine._unmeasured and big[0] not in engine._allocs
    assert not any(r.key == big[0] for ex in _region_executors(engine) for r in ex.compiled_regions()
                   if ex is engine._executors.get(engine._schedules[engine._last_key].gm))
    engine.close()


def _region(graph: fx.Graph, metas) -> Region:
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    return Region(0, nodes=[n for n in graph.nodes if n.op == "call_function"], inputs=inputs, graph=graph,
                  input_metas=metas, written=written_inputs(graph))


def test_layout_mismatch_names_the_node():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output((g.call_function(aten.mm.default, (a, b)),))
    x, w = torch.randn(4, 8), torch.randn(8, 4)
    r = _region(g, [TensorMeta.of(x, x.device), TensorMeta.of(w, w.device)])
    assert written_inputs(g) == frozenset() and layout_mismatch(r, [x, w]) is None
    transposed = w.t().contiguous().t()                       # same values, other strides
    assert "node b as stride (1, 8), compiled for (4, 1)" in layout_mismatch(r, [x, transposed])
    assert "dtype torch.float64" in layout_mismatch(r, [x, w.double()])
    offset = torch.randn(8 * 4 + 1)[1:].view(8, 4)             # 4 bytes into its storage
    assert "16-byte alignment False" in layout_mismatch(r, [x, offset])


def test_a_region_that_writes_an_input_must_not_share_its_storage():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    v = g.call_function(aten.view.default, (a, [8]))
    d = g.call_function(aten.div_.Tensor, (v, 2.0))
    g.output((g.call_function(aten.add.Tensor, (d, b)),))
    x = torch.randn(8)
    r = _region(g, [TensorMeta.of(x, x.device)] * 2)
    assert r.written == frozenset({0})
    assert layout_mismatch(r, [x.clone(), x.clone()]) is None
    base = torch.randn(16)
    assert "writes node a, which shares its storage with input b" in layout_mismatch(r, [base[:8], base[8:]])
