"""Activation recomputation in compiled mode (``passes/recompute_activations.py``, ``Config.activations``).

- the rewritten graph computes exactly what the captured one does (dropout included: random
  numbers are drawn once, in the forward) and its static non-model peak is lower;
- training with recomputation tracks plain PyTorch step by step (GPT and BERT, dropout on) under
  budgets below what keeping every activation needs, so every step evicts; peak within budget and
  bytes moved as planned on every step (the executor checks the bytes);
- "auto" recomputes nothing when the graph fits, some segments in between, everything at the
  minimum; "keep" refuses budgets that only recomputation reaches;
- the schedule says what it recomputed.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
import pscompile.compiled.engine as compiled_engine
import pscompile.graph.pipeline as pipeline
from pscompile.graph.capture import capture_joint
from pscompile.graph.meta import get
from pscompile.graph.pipeline import capture_and_analyze, choose_activations
from pscompile.memory.rates import Rates
from pscompile.passes.recompute_activations import find_segments, recompute_activations
from pscompile.testing import ReferenceTrainer
from conftest import (TRACKING_TOL, tracking_tol, activations_config, assert_graphs_agree, fresh_masters, make_batches,
                      make_model, tracking_of)

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
DROPOUT = 0.1


def _config(policy: str, budget=None, dtype=torch.float32, **kw) -> pscompile.Config:
    if policy == "auto":      # over a slow link "auto" recomputes rather than offloads (test_offload.py: the other way)
        kw.setdefault("link_bandwidth", "100MB/s")
    return activations_config(policy, budget, dtype, **kw)


def _minimum(kind: str, policy: str) -> int:
    return pscompile.min_device_memory(make_model(kind, dropout=DROPOUT), make_batches(kind, 1)[0], _config(policy))


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_the_rewritten_graph_computes_the_same_values_with_less_live_memory(kind):
    model = make_model(kind, dropout=DROPOUT)
    batch = make_batches(kind, 1)[0]
    params = dict(model.named_parameters())
    captured = capture_joint(model, batch, params=params)
    segments = find_segments(captured)
    assert len(segments) >= 4 and all(s.saved_bytes > 0 for s in segments)
    rewritten = recompute_activations(captured, segments)
    assert_graphs_agree(captured, rewritten, params, batch)       # the same ops on the same values: bit for bit
    masks = [n for n in captured.gm.graph.nodes if n.target is torch.ops.aten.div_.Scalar
             and torch.Tag.nondeterministic_seeded in getattr(n.args[0].target, "tags", ())]
    kept = [n for n in rewritten.gm.graph.nodes if n.target is torch.ops.aten.ne.Scalar and get(n, "mask_of")]
    assert len(kept) == len(masks) >= 3 and all(n.meta["val"].dtype == torch.bool for n in kept)   # a byte each
    clones = [n for n in rewritten.gm.graph.nodes if get(n, "recomputes") is not None]
    assert len(clones) == sum(s.nodes for s in segments)
    assert not any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in clones)
    assert not any(getattr(getattr(n.target, "_schema", None), "is_mutable", False) for n in clones)
    assert captured.gm.graph is not rewritten.gm.graph and len(list(captured.gm.graph.nodes)) < len(
        list(rewritten.gm.graph.nodes))        # the input graph is left as it was
    from pscompile.graph.analysis import _analyze, _Passes
    before = _analyze(captured, _Passes()).nonmodel
    after = _analyze(rewritten, _Passes()).nonmodel
    assert max(after) < 0.85 * max(before), (max(after), max(before))


class _RandBlocks(torch.nn.Module):
    """Residual MLP blocks with a dropout written as ``rand_like < keep`` (a random op with no
    in-place op after it), so that only the random-op rule keeps the forward's mask."""

    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width),
                                                              torch.nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            h = block(x)
            keep = (torch.rand_like(h) < 0.9).to(h.dtype)
            x = x + h * keep / 0.9
        return (x * x).mean()


def test_a_random_op_is_never_recomputed():
    torch.manual_seed(0)
    model, x = _RandBlocks(), torch.randn(4, 8, 32)
    params = dict(model.named_parameters())
    captured = capture_joint(model, (x,), params=params)
    rewritten = recompute_activations(captured, find_segments(captured))
    inputs = [p.detach() for p in params.values()] + [x]
    torch.manual_seed(3)
    want = captured.gm(*inputs)
    torch.manual_seed(3)
    got = rewritten.gm(*inputs)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def _train(kind: str, policy: str, budget: int | None, steps: int = 6, dtype=torch.float32):
    ref = ReferenceTrainer(make_model(kind, dropout=DROPOUT), optimizer=HP, dtype=dtype)
    initial = fresh_masters(kind, dtype, dropout=DROPOUT)
    batches = make_batches(kind, steps)
    engine = pscompile.compile(make_model(kind, dropout=DROPOUT), batches[0], optimizer=HP,
                               config=_config(policy, budget, dtype))
    worst_loss = 0.0
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        want = ref.step(b)
        torch.manual_seed(100 + i)
        got = engine.step(b)
        worst_loss = max(worst_loss, abs(got - want) / abs(want))
        if budget is not None:
            assert engine.stats.peak_device_bytes <= budget, (i, engine.stats.peak_device_bytes, budget)
            assert engine.stats.h2d_bytes > 0 and engine.stats.num_evictions > 0, "the budget must evict"
    tracking = tracking_of(engine.state_dict()["master"], ref, initial)
    return engine, worst_loss, tracking


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_training_with_recomputation_tracks_plain_pytorch_below_the_keep_minimum(kind, policy, monkeypatch):
    # "auto" weighs recomputing against offloading with the rates it measures; under load the
    # measured matmul rate can fall far enough that offloading wins, so the rates are fixed here:
    # 10 GFLOP/s of compute against the 100 MB/s link (test_offload.py covers the other way)
    fixed = lambda *a, **k: Rates(1e10, 1e8)       # noqa: E731
    monkeypatch.setattr(compiled_engine, "measure_rates", fixed)
    monkeypatch.setattr(pipeline, "measure_rates", fixed)
    keep, least = _minimum(kind, "keep"), _minimum(kind, policy)
    assert least < 0.8 * keep, (least, keep)
    budget = least + (keep - least) // 4          # only recomputation reaches it
    engine, worst_loss, (tracking, name) = _train(kind, policy, budget)
    assert worst_loss <= 1e-5
    assert tracking <= TRACKING_TOL, name
    plan = engine.schedule.scheduled.activations
    assert plan is not None and plan.recomputed
    if policy == "auto":
        assert len(plan.recomputed) < len(plan.segments), "auto recomputes only what the budget needs"


def test_bfloat16_training_with_recomputation_tracks_plain_pytorch():
    """bf16 compute, fp32 masters: the per-tensor tracking tolerance of the parity tests."""
    least = pscompile.min_device_memory(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                                        _config("recompute", dtype=torch.bfloat16))
    engine, worst_loss, (tracking, name) = _train("gpt", "recompute", least, steps=4, dtype=torch.bfloat16)
    assert worst_loss <= 2e-2 and tracking <= tracking_tol(torch.bfloat16), (worst_loss, tracking, name)
    assert engine.schedule.scheduled.activations.recomputed


def test_auto_recomputes_nothing_when_the_graph_fits_and_keep_refuses_what_only_recomputation_reaches():
    keep = _minimum("gpt", "keep")
    assert _minimum("gpt", "auto") == _minimum("gpt", "recompute") < keep
    engine = pscompile.compile(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                               config=_config("auto", keep))
    assert engine.schedule.scheduled.activations.recomputed == ()
    assert "every saved activation kept" in str(engine.schedule)
    with pytest.raises(pscompile.BudgetError, match=f"give device_memory >= {keep}"):
        pscompile.compile(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                          config=_config("keep", keep - 4096))


def test_auto_picks_more_segments_as_the_budget_shrinks():
    model = make_model("gpt", dropout=DROPOUT)
    batch = make_batches("gpt", 1)[0]
    config = _config("auto")
    from pscompile.graph.pipeline import plan_inputs
    layout, analyzed = plan_inputs(model, batch, config)
    keep, least = _minimum("gpt", "keep"), _minimum("gpt", "auto")
    variants: dict = {}
    counts = []
    for k in range(9):
        budget = keep - (keep - least) * k // 8
        chosen = choose_activations(analyzed, layout, policy="auto", budget=budget, slot_bytes=layout.chunk_size * 4,
                                    variants=variants)
        counts.append(len(chosen.activations.recomputed))
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] >= 1 and len(set(counts)) >= 3, counts


def test_the_schedule_shows_what_was_recomputed():
    budget = _minimum("gpt", "recompute")
    engine = pscompile.compile(make_model("gpt", dropout=DROPOUT), make_batches("gpt", 1)[0],
                               config=_config("recompute", budget))
    text = str(engine.schedule)
    assert "# activations recompute: 5 of 5 segments recomputed" in text
    backward = text.split("# ---- backward ----")[1]
    assert backward.count("# recomputes ") == engine.schedule.scheduled.activations.recomputed_nodes
    assert "recompute_activations" in text.split("def iteration")[0]        # the pass in the provenance


def test_evaluation_and_hooks_mode_are_left_alone():
    batch, model = make_batches("gpt", 1)[0], make_model("gpt")
    analyzed = capture_and_analyze(model, batch, params=dict(model.named_parameters()), dtype=torch.float32,
                                   backward=False)
    assert find_segments(analyzed.captured) == ()
    with pytest.raises(ValueError, match="activations='recompute' is planned in compiled mode"):
        pscompile.Config(mode="hooks", activations="recompute")
    with pytest.raises(ValueError, match="activations='sometimes' is not a policy"):
        pscompile.Config(activations="sometimes")


def test_inductor_regions_run_the_recomputed_graph():
    """backend="inductor" compiles the rewritten graph's regions (not node by node) and keeps
    parity and the budget; dropout runs with Inductor's fallback_random."""
    batches = make_batches("gpt", 4)
    least = _minimum("gpt", "recompute")
    budget = int(least * 1.3)
    ref = ReferenceTrainer(make_model("gpt", dropout=DROPOUT), optimizer=HP, dtype=torch.float32)
    initial = fresh_masters("gpt", torch.float32, dropout=DROPOUT)
    config = pscompile.Config(mode="compiled", backend="inductor", device="cpu", dtype=torch.float32,
                              device_memory=budget, activations="recompute")
    engine = pscompile.compile(make_model("gpt", dropout=DROPOUT), batches[0], optimizer=HP, config=config)
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        want = ref.step(b)
        torch.manual_seed(100 + i)
        assert engine.step(b) == pytest.approx(want, rel=1e-5)
        assert engine.stats.peak_device_bytes <= budget
    worst, name = tracking_of(engine.state_dict()["master"], ref, initial)
    assert worst <= TRACKING_TOL, name


def test_a_ranges_sizes_are_not_activations():
    """A range's symbolic capture reads the batch's length (``sym_size``) all through the forward.
    A size is no activation: the segments are those of the plain capture of one length (as a
    tensor it was one value live from the first layer to the loss: no cut, one segment, and the
    range's warm steps offloaded the whole forward)."""
    from pscompile.graph.analysis import analyze_at_bound
    from pscompile.testing import tiny_model
    model, batch = tiny_model("gpt", seq_len=32)
    params = dict(model.named_parameters())
    plain = capture_joint(model, batch, params=params)
    ranged = capture_joint(model, batch, params=params, dynamic=((0, 1), (1, 1)))
    at_bound = analyze_at_bound(ranged, (32, 32)).captured
    assert any(n.target is torch.ops.aten.sym_size.int for n in at_bound.gm.graph.nodes)
    want = [s.saved_bytes for s in find_segments(plain)]
    assert len(want) > 2
    assert [s.saved_bytes for s in find_segments(at_bound)] == want
