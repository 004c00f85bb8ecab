"""Hooks engine behaviour: budgets, errors that lose nothing, state dicts, loss scaling, plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pscompile
from pscompile.hooks.access_plan import AccessPlan, Moment
from pscompile.errors import BudgetError
from pscompile.testing import ReferenceTrainer
from conftest import gpt_batches, make_model, max_weight_diff

CFG = dict(mode="hooks", device="cpu", dtype=torch.float32, chunk_size=2048)


def test_budget_below_minimum_names_the_minimum_and_the_minimum_works():
    b = gpt_batches(1)[0]
    with pytest.raises(ValueError, match=r"device_memory=.* is below the minimum .* give device_memory >= (\d+)") as info:
        pscompile.compile(make_model("gpt"), b, config=pscompile.Config(device_memory="1MiB", **CFG))
    minimum = int(info.value.args[0].split("give device_memory >= ")[1].split(",")[0])
    assert "moment" in str(info.value) and "non-model" in str(info.value)
    engine = pscompile.compile(make_model("gpt"), b, config=pscompile.Config(device_memory=minimum, **CFG))
    for _ in range(2):
        engine.step(b)
        assert engine.stats.peak_device_bytes <= minimum
        assert engine.stats.num_evictions > 0


class _Poison(torch.autograd.Function):
    """Identity whose backward raises while ``armed`` is set."""

    armed = [False]

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Poison.armed[0]:
            raise RuntimeError("poisoned backward")
        return g


class PoisonedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)

    def forward(self, idx, targets):
        x = _Poison.apply(self.emb(idx))              # raises late in backward: most grads written
        logits = self.fc2(torch.relu(self.fc1(x)))
        return nn.functional.cross_entropy(logits.view(-1, 64), targets.view(-1))


@pytest.mark.parametrize("device_memory", [None, 80 * 1024])
def test_failed_step_leaves_weights_and_states_as_they_were(device_memory):
    torch.manual_seed(0)
    hp = pscompile.AdamW(lr=1e-2)
    batches = gpt_batches(4, batch=2, seq=8, vocab=64)
    torch.manual_seed(0)
    ref = ReferenceTrainer(PoisonedMLP(), optimizer=hp, dtype=torch.float32)
    torch.manual_seed(0)
    engine = pscompile.compile(PoisonedMLP(), batches[0], optimizer=hp,
                               config=pscompile.Config(mode="hooks", device="cpu", dtype=torch.float32,
                                                       chunk_size=1024, device_memory=device_memory))
    ref.step(batches[0]); engine.step(batches[0])
    before = engine.state_dict()
    _Poison.armed[0] = True
    try:
        with pytest.raises(RuntimeError, match="poisoned"):
            engine.step(batches[1])
    finally:
        _Poison.armed[0] = False
    after = engine.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for f in before[key]:
            assert torch.equal(before[key][f], after[key][f]), (key, f)
    assert after["step"] == before["step"]
    for b in batches[1:]:                      # and training goes on exactly like plain PyTorch
        assert engine.step(b) == pytest.approx(ref.step(b), rel=1e-6)
    assert max_weight_diff(engine, ref) < 1e-5


def test_bad_batch_raises_and_loses_nothing():
    b = gpt_batches(1)[0]
    engine = pscompile.compile(make_model("gpt"), b, config=pscompile.Config(**CFG))
    engine.step(b)
    before = engine.state_dict()
    bad = (b[0], b[1][:, :10])                 # targets of the wrong shape
    with pytest.raises((RuntimeError, ValueError)):
        engine.step(bad)
    after = engine.state_dict()
    assert all(torch.equal(before["master"][f], after["master"][f]) for f in before["master"])
    engine.step(b)


def test_state_dict_round_trip_continues_identically():
    batches = gpt_batches(5)
    hp = pscompile.AdamW(lr=1e-3)
    a = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp, config=pscompile.Config(**CFG))
    for b in batches[:3]:
        a.step(b)
    sd = a.state_dict()
    losses_a = [a.step(b) for b in batches[3:]]
    c = pscompile.compile(make_model("gpt", seed=7), batches[0], optimizer=hp,
                          config=pscompile.Config(device_memory=4 * 2**20, **CFG))
    c.load_state_dict(sd)
    losses_c = [c.step(b) for b in batches[3:]]
    assert losses_a == pytest.approx(losses_c, rel=1e-6)
    bad = dict(sd, master={k: v for k, v in list(sd["master"].items())[1:]})
    with pytest.raises(ValueError, match="lacks parameters"):
        c.load_state_dict(bad)


def test_full_state_dict_loads_into_the_model_class():
    batches = gpt_batches(2)
    engine = pscompile.compile(make_model("gpt"), batches[0], config=pscompile.Config(**CFG))
    engine.step(batches[0])
    fresh = make_model("gpt", seed=3)
    fresh.load_state_dict(engine.full_state_dict())      # strict: every key present, tied names too
    with torch.no_grad():
        expected = float(fresh(*batches[1]))
    assert engine.step(batches[1]) == pytest.approx(expected, rel=1e-6)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc(x), y)


def test_parameters_without_gradients_are_not_updated():
    torch.manual_seed(0)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    hp = pscompile.AdamW(lr=1e-2, weight_decay=0.5)
    torch.manual_seed(0)
    ref = ReferenceTrainer(WithUnused(), optimizer=hp, dtype=torch.float32)
    torch.manual_seed(0)
    model = WithUnused()
    w0 = model.unused.weight.detach().clone()
    engine = pscompile.compile(model, (x, y), optimizer=hp, config=pscompile.Config(**dict(CFG, chunk_size=512)))
    for _ in range(3):
        assert engine.step((x, y)) == pytest.approx(ref.step((x, y)), rel=1e-6)
    assert torch.equal(engine.state_dict()["master"]["unused.weight"], w0)
    assert max_weight_diff(engine, ref) < 1e-6


class TinyFP16(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc2(torch.tanh(self.fc1(x))).float(), y)


def test_fp16_dynamic_loss_scaling_skips_overflow_and_tracks_plain_pytorch():
    torch.manual_seed(0)
    data = [(torch.randn(16, 8).half(), torch.randint(0, 4, (16,))) for _ in range(6)]
    hp = pscompile.AdamW(lr=1e-2)
    cfg = pscompile.Config(mode="hooks", device="cpu", dtype=torch.float16, chunk_size=64,
                           initial_loss_scale=2.0**40)          # overflows until it backs off
    torch.manual_seed(0)
    ref = ReferenceTrainer(TinyFP16(), optimizer=hp, dtype=torch.float16, initial_loss_scale=2.0**40)
    torch.manual_seed(0)
    engine = pscompile.compile(TinyFP16(), data[0], optimizer=hp, config=cfg)
    sd0 = engine.state_dict()
    engine.step(data[0]); ref.step(data[0])
    assert engine.stats.skipped and engine.stats.loss_scale == 2.0**40
    sd1 = engine.state_dict()
    assert all(torch.equal(sd0["master"][f], sd1["master"][f]) for f in sd0["master"])
    assert sd1["loss_scale"] == 2.0**39 and sd1["step"] == 0
    skipped = 1
    for b in data[1:] * 5:
        a, r = engine.step(b), ref.step(b)
        assert a == pytest.approx(r, rel=2e-2)
        skipped += engine.stats.skipped
    assert skipped < 30 and engine.scaler.scale == ref.scaler.scale
    assert max_weight_diff(engine, ref) < 1e-2
    good = engine.state_dict()                # a loss scale's state refused before anything changes
    for field, value in (("loss_scale", float("nan")), ("loss_scale", True), ("loss_scale_good_steps", "7"),
                         ("loss_scale_good_steps", -1)):
        with pytest.raises(ValueError, match=f"state_dict\\['{field}'\\]"):
            engine.load_state_dict({**sd0, field: value})
        assert engine.scaler.scale == good["loss_scale"] and engine.state_dict()["step"] == good["step"]


def test_output_forms_and_loss_fn():
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return {"loss": self.fc(x).pow(2).mean(), "logits": None}

    x = torch.randn(2, 4)
    assert pscompile.compile(DictOut(), (x,), config=pscompile.Config(**CFG)).step((x,)) > 0

    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    with pytest.raises(ValueError, match="scalar"):
        pscompile.compile(Raw(), (x,), config=pscompile.Config(**CFG))
    e = pscompile.compile(Raw(), {"x": x}, config=pscompile.Config(**CFG), loss_fn=lambda out, batch: out.abs().mean())
    assert e.step({"x": x}) > 0


def test_new_batch_shape_gets_its_own_trace():
    b1, b2 = gpt_batches(1, batch=2)[0], gpt_batches(1, batch=6)[0]
    engine = pscompile.compile(make_model("gpt"), b1, config=pscompile.Config(device_memory=6 * 2**20, **CFG))
    engine.step(b1)
    engine.step(b2)
    assert len(engine._plans) == 2
    assert engine.stats.peak_device_bytes <= 6 * 2**20


def test_next_use_is_cyclic_and_farthest_wins():
    m = lambda *need: Moment("fwd", "x", need, 0, 0)  # noqa: E731
    plan = AccessPlan((m(0), m(1), m(2), m(0), m(1), m()))
    assert plan.next_use(0, 0) == 3
    assert plan.next_use(2, 2) == 2 + 6          # next iteration
    assert plan.next_use(1, 4) == 1 + 6
    assert plan.next_use(5, 0) == float("inf")
    assert plan.farthest([0, 1, 2], 3) == 2      # 0 -> 6, 1 -> 4, 2 -> 8


def test_meta_device_model_is_materialized_with_ties_kept():
    from pscompile.models.gpt import GPT, gpt_config
    with torch.device("meta"):
        model = GPT(gpt_config("gpt-tiny"))
    batches = gpt_batches(4, batch=2)
    engine = pscompile.compile(model, batches[0], optimizer=pscompile.AdamW(lr=1e-2),
                               config=pscompile.Config(**CFG))
    assert engine.materialized == len(list(model.parameters()))
    assert model.lm_head.weight is model.wte.weight
    losses = [engine.step(batches[0]) for _ in range(4)]
    assert all(l == l for l in losses) and losses[-1] < losses[0]
    sd = engine.full_state_dict()
    assert torch.equal(sd["lm_head.weight"], sd["wte.weight"])


def test_meta_module_without_reset_parameters_is_refused():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, device="meta"))

        def forward(self, x):
            return (x * self.w).sum()

    with pytest.raises(ValueError, match="reset_parameters"):
        pscompile.compile(Bare(), (torch.randn(4),), config=pscompile.Config(**CFG))


def test_emulated_link_costs_bytes_over_bandwidth():
    b = gpt_batches(1)[0]
    bandwidth = 20e6
    engine = pscompile.compile(make_model("gpt"), b, config=pscompile.Config(
        device_memory=3 * 2**20 + 2**19, link_bandwidth=bandwidth, **CFG))   # evicts: bytes cross the link
    engine.step(b)
    s = engine.stats
    assert s.bytes_moved > 0
    expected = s.bytes_moved / bandwidth
    assert expected * 0.8 <= s.transfer_s <= expected * 1.2 + 0.05, (s.transfer_s, expected)
    assert s.time_s >= s.transfer_s


def test_a_disk_dir_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="disk_dir=.* is not an existing folder"):
        pscompile.Config(disk_dir=str(tmp_path / "missing"), **CFG)


def test_failed_compile_gives_the_model_back():
    b = gpt_batches(1)[0]
    model = make_model("gpt")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(BudgetError):
        pscompile.compile(model, b, config=pscompile.Config(device_memory="1MiB", **CFG))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        expected = float(model(*b))
    engine = pscompile.compile(model, b, config=pscompile.Config(device_memory="8MiB", **CFG))
    assert engine.step(b) == pytest.approx(expected, rel=1e-6)
    engine.close()                      # and close() hands back the trained weights
    assert not torch.equal(model.h[0].mlp.c_fc.weight, before["h.0.mlp.c_fc.weight"])
    with pytest.raises(RuntimeError, match="closed"):
        engine.step(b)


def test_frozen_parameters_stay_frozen():
    torch.manual_seed(0)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    model = WithUnused()
    model.fc.bias.requires_grad_(False)
    b0 = model.fc.bias.detach().clone()
    engine = pscompile.compile(model, (x, y), optimizer=pscompile.AdamW(lr=1e-2, weight_decay=0.5),
                               config=pscompile.Config(**dict(CFG, chunk_size=512)))
    for _ in range(2):
        engine.step((x, y))
    assert torch.equal(engine.full_state_dict()["fc.bias"], b0)
    assert "fc.bias" not in engine.state_dict()["master"]     # (a frozen parameter has no optimizer state)
    assert engine.layout.is_frozen(engine.layout.entry("fc.bias").chunks[0])
    assert not model.fc.bias.requires_grad


def test_spanning_weights_keep_no_gathered_copy_until_backward():
    """A weight larger than a chunk is gathered for its forward, re-gathered in backward: the
    peak non-model memory equals the run where it fits in one chunk."""
    b = gpt_batches(1)[0]
    peaks = {}
    for cs in (16384, 2048):
        engine = pscompile.compile(make_model("gpt"), b, config=pscompile.Config(**dict(CFG, chunk_size=cs)))
        engine.step(b)
        peaks[engine.layout.entry("wte.weight").spans] = engine.stats.peak_nonmodel_bytes
    assert peaks[True] == peaks[False]


def test_dropped_engine_is_freed():
    import gc
    import weakref
    engine = pscompile.compile(make_model("gpt"), gpt_batches(1)[0], config=pscompile.Config(**CFG))
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None, "hooks on the model keep the engine (and its chunks) alive"


def test_learning_rate_can_follow_a_schedule():
    batches = gpt_batches(3)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp, config=pscompile.Config(**CFG))
    for i, b in enumerate(batches):
        lr = 1e-3 * (i + 1)
        engine.lr = lr
        for group in ref.opt.param_groups:
            group["lr"] = lr
        assert engine.step(b) == pytest.approx(ref.step(b), rel=1e-6)
    assert engine.lr == 3e-3
    assert max_weight_diff(engine, ref) < 1e-5
    with pytest.raises(ValueError, match="lr"):
        engine.lr = -1.0


def test_evaluate_is_the_models_own_no_grad_loss_and_changes_nothing(tight_budget):
    batches = gpt_batches(3)
    budget = tight_budget("gpt", torch.float32)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=hp,
                               config=pscompile.Config(**dict(CFG, device_memory=budget)))
    for b in batches[:2]:
        engine.step(b), ref.step(b)
    before = engine.state_dict()
    with torch.no_grad():
        expected = float(ref.model(*batches[2]))
    assert engine.evaluate(batches[2]) == pytest.approx(expected, rel=1e-6)
    assert engine.eval_peak_device_bytes <= budget
    after = engine.state_dict()
    assert all(torch.equal(before["master"][f], after["master"][f]) for f in before["master"])
    # training continues exactly as plain PyTorch after an evaluation
    assert engine.step(batches[2]) == pytest.approx(ref.step(batches[2]), rel=1e-6)
    assert max_weight_diff(engine, ref) < 1e-5


def test_a_new_batch_shape_mid_training_keeps_device_updated_weights():
    """Tracing a new shape evicts chunks updated on the device with a copy, not a drop."""
    b1, b2 = gpt_batches(1, batch=2)[0], gpt_batches(1, batch=3)[0]
    hp = pscompile.AdamW(lr=1e-2)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=torch.float32)
    engine = pscompile.compile(make_model("gpt"), b1, optimizer=hp, config=pscompile.Config(**CFG))
    assert any(t is pscompile.Tier.DEVICE for t in engine.store.os_tier)
    for b in (b1, b1, b2, b1):
        assert engine.step(b) == pytest.approx(ref.step(b), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradient_accumulation_matches_plain_pytorch(dtype, tight_budget):
    """engine.step([b1, b2, b3, b4]): gradients of four micro-batches accumulate (fp32, host) into
    one update, like (loss / 4).backward() four times in plain PyTorch."""
    micro = gpt_batches(8, batch=2)
    hp = pscompile.AdamW(lr=1e-3, max_grad_norm=1.0)
    budget = tight_budget("gpt", dtype)
    ref = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(make_model("gpt"), micro[0], optimizer=hp,
                               config=pscompile.Config(**dict(CFG, dtype=dtype, device_memory=budget)))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(2):
        group = micro[4 * step:4 * step + 4]
        a, c = ref.step(group), engine.step(group)
        assert abs(a - c) <= tol * abs(a)
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
    assert max_weight_diff(engine, ref) <= (1e-5 if dtype == torch.float32 else 5e-2)
    first_only = ReferenceTrainer(make_model("gpt"), optimizer=hp, dtype=dtype)
    for step in range(2):                   # stepping on one micro-batch each time lands elsewhere
        first_only.step(micro[4 * step])
    assert max_weight_diff(engine, first_only) > 1e-4
