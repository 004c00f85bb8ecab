"""Compiled mode in real training loops: evaluate() (forward-only schedule) and gradient
accumulation (engine.step([b1, .., bk]) with an accumulation schedule), against plain PyTorch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pscompile
from pscompile.graph.meta import get
from pscompile.graph.ops import is_memory_node
from pscompile.testing import ReferenceTrainer
from conftest import TRACKING_TOL, TRACKING_TOL_BF16_ACCUMULATION, fresh_masters, gpt_batches, make_model, max_weight_diff, worst_tracking
from test_compiled_parity import compiled_config, min_budget

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def memory_kinds(schedule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in schedule.gm.graph.nodes:
        if is_memory_node(n):
            kind = get(n, "mem").kind
            out[kind] = out.get(kind, 0) + 1
    return out


def test_evaluate_is_the_models_no_grad_loss_and_changes_nothing():
    batches = gpt_batches(3)
    budget = min_budget("gpt", torch.float32) + (128 << 10)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp,
                               config=compiled_config(torch.float32, budget))
    for b in batches[:2]:
        engine.step(b), ref.step(b)
    before = engine.state_dict()
    with torch.no_grad():
        expected = float(ref.model(*batches[2]))
    for _ in range(2):                     # the warm-up (measuring) run, then the measured plan
        assert engine.evaluate(batches[2]) == pytest.approx(expected, rel=1e-6)
        assert engine.eval_peak_device_bytes <= budget
        assert engine.eval_plan.d2h_bytes == 0          # nothing is dirty: no gradient, no writeback
    kinds = memory_kinds(engine.schedule_of(batches[2], "eval"))
    assert "store_grad" not in kinds and "writeback" not in kinds and kinds.get("fetch", 0) > 0
    after = engine.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key
    assert after["step"] == before["step"]
    # training continues exactly as plain PyTorch after an evaluation
    assert engine.step(batches[2]) == pytest.approx(ref.step(batches[2]), rel=1e-6)
    assert max_weight_diff(engine, ref) < 1e-5


def test_evaluate_follows_train_and_eval_mode_like_plain_pytorch():
    """Dropout is captured as the model's mode says: eval() gives the deterministic loss, and
    train() steps afterwards still match plain PyTorch (their own schedule, seeded dropout)."""
    batches = gpt_batches(2)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model("gpt", dropout=0.1), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt", dropout=0.1), batches[0], optimizer=hp,
                               config=compiled_config(torch.float32, None))
    for i, b in enumerate(batches):
        torch.manual_seed(i)
        a = ref.step(b)
        torch.manual_seed(i)
        assert engine.step(b) == pytest.approx(a, rel=1e-5)
    engine.model.eval()
    ref.model.eval()
    with torch.no_grad():
        expected = float(ref.model(*batches[0]))
    assert engine.evaluate(batches[0]) == pytest.approx(expected, rel=1e-6)
    assert engine.evaluate(batches[0]) == engine.evaluate(batches[0])    # no dropout in eval()
    engine.model.train()
    ref.model.train()
    torch.manual_seed(7)
    a = ref.step(batches[1])
    torch.manual_seed(7)
    assert engine.step(batches[1]) == pytest.approx(a, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_accumulation_matches_plain_pytorch(dtype):
    """engine.step([b1, b2, b3, b4]) runs the accumulation schedule four times (gradients added
    into fp32 host chunks) and updates once, like (loss / 4).backward() four times in plain
    PyTorch; under a budget that evicts every micro-batch."""
    micro = gpt_batches(8, batch=2)
    hp = pscompile.AdamW(lr=1e-3, max_grad_norm=1.0)
    budget = min_budget("gpt", dtype, batch=2) + (128 << 10)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(make_model("gpt"), micro[0], optimizer=hp, config=compiled_config(dtype, budget))
    elsize = torch.empty((), dtype=dtype).element_size()
    grad_bytes = sum(p.numel() for p in engine.params.values()) * elsize
    for step in range(2):
        group = micro[4 * step:4 * step + 4]
        a, c = ref.step(group), engine.step(group)
        assert abs(a - c) <= TOL[dtype] * abs(a), f"step {step}: plain {a} vs compiled {c}"
        s, plan = engine.stats, engine.last_plan
        assert s.peak_device_bytes <= budget and s.num_evictions > 0
        assert plan.d2h_bytes == grad_bytes            # every gradient crosses once; no writebacks
        assert s.d2h_bytes == 4 * plan.d2h_bytes and s.h2d_bytes >= 4 * plan.h2d_bytes
    kinds = memory_kinds(engine.schedule_of(micro[0], "accum"))
    pages = sum(len(engine.layout.entry(f).pieces) for f in engine.params)     # one per page of a spanning tensor
    assert kinds["accumulate_grad"] == pages and "store_grad" not in kinds
    assert "writeback" not in kinds
    assert max_weight_diff(engine, ref) <= (1e-5 if dtype == torch.float32 else 5e-2)
    tol = TRACKING_TOL if dtype == torch.float32 else TRACKING_TOL_BF16_ACCUMULATION
    assert worst_tracking(engine, ref, fresh_masters("gpt", dtype))[0] <= tol
    first_only = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=dtype)
    for step in range(2):                   # stepping on one micro-batch each time lands elsewhere
        first_only.step(micro[4 * step])
    assert max_weight_diff(engine, first_only) > 1e-4
    # a plain step after accumulation uses the ordinary schedule and still matches
    assert engine.step(micro[0]) == pytest.approx(ref.step(micro[0]), rel=TOL[dtype])


def test_a_failed_micro_batch_loses_nothing():
    micro = gpt_batches(4, batch=2)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), micro[0], optimizer=hp,
                               config=compiled_config(torch.float32, min_budget("gpt", torch.float32, batch=2)
                                                      + (128 << 10)))
    engine.step(micro[:2]), ref.step(micro[:2])
    before = engine.state_dict()
    bad = (micro[3][0].clone(), micro[3][1])
    bad[0][0, 0] = 10_000                   # a token id outside the vocabulary: fails inside the graph
    with pytest.raises(IndexError):
        engine.step([micro[2], bad])
    after = engine.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key
    assert all(not a.any() for a in engine._acc)      # the half-accumulated gradient is gone
    assert engine.step(micro[2:]) == pytest.approx(ref.step(micro[2:]), rel=1e-6)
    assert max_weight_diff(engine, ref) < 1e-5


def test_inductor_backend_accumulates_and_evaluates():
    """The same loops with the regions compiled by Inductor (the accumulation schedule reuses the
    training schedule's compiled regions where they are the same code)."""
    micro = gpt_batches(4, batch=2)
    hp = pscompile.AdamW(lr=1e-3)
    budget = min_budget("gpt", torch.float32, batch=2) + (128 << 10)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), micro[0], optimizer=hp,
                               config=dataclasses.replace(compiled_config(torch.float32, budget),
                                                                  backend="inductor"))
    for _ in range(2):
        assert engine.step(micro) == pytest.approx(ref.step(micro), rel=1e-5)
        assert engine.stats.peak_device_bytes <= budget
    with torch.no_grad():
        expected = float(ref.model(*micro[0]))
    for _ in range(2):
        assert engine.evaluate(micro[0]) == pytest.approx(expected, rel=1e-5)
    assert max_weight_diff(engine, ref) < 1e-5


def test_state_dict_round_trip_with_warm_chunks_resident():
    """load_state_dict while an evaluation left chunks on the device: the next runs start cold
    from the loaded weights and keep matching plain PyTorch."""
    bs = gpt_batches(5, batch=2)
    hp = pscompile.AdamW(lr=1e-3)
    budget = min_budget("gpt", torch.float32, batch=2) + (128 << 10)
    engine = pscompile.compile(make_model("gpt"), bs[0], optimizer=hp, config=compiled_config(torch.float32, budget))
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine.step(bs[:2]), ref.step(bs[:2])
    saved = engine.state_dict()
    engine.step(bs[2:4])                       # moves away from the saved state
    engine.evaluate(bs[2]), engine.evaluate(bs[2])
    assert len(engine.moves.residency()) > sum(t is pscompile.Tier.DEVICE for t in engine.store.os_tier)
    engine.load_state_dict(saved)
    with torch.no_grad():
        expected = float(ref.model(*bs[2]))
    assert engine.evaluate(bs[2]) == pytest.approx(expected, rel=1e-6)
    assert engine.step(bs[2:4]) == pytest.approx(ref.step(bs[2:4]), rel=1e-6)
    assert engine.step(bs[4]) == pytest.approx(ref.step(bs[4]), rel=1e-6)
    assert max_weight_diff(engine, ref) < 1e-5
