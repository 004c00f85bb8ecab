"""``engine.optimizer`` under ``torch.optim.lr_scheduler``: warm-up + cosine, ``OneCycleLR`` (which
cycles beta1 too) and ``LambdaLR`` drive a pscompile engine exactly as they drive
``torch.optim.AdamW`` (the same rates every step, the same losses), in both modes under a budget that
evicts, and a scheduler resumes exactly through ``pscompile.save(client_state=...)`` / ``load``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim import lr_scheduler as sched

import pscompile
from pscompile.testing import ReferenceTrainer
from conftest import make_batches, make_model

HP = pscompile.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, param_groups=[
    {"params": lambda name, p: p.ndim < 2, "weight_decay": 0.0, "lr": 1e-3}])
STEPS, SAVE_AT = 6, 3

SCHEDULES = {
    "warmup-cosine": lambda opt: sched.SequentialLR(opt, [sched.LinearLR(opt, start_factor=0.1, total_iters=2),
                                                          sched.CosineAnnealingLR(opt, T_max=STEPS - 2)],
                                                    milestones=[2]),
    "one-cycle": lambda opt: sched.OneCycleLR(opt, max_lr=[2e-3, 6e-3], total_steps=STEPS),
    "lambda": lambda opt: sched.LambdaLR(opt, lambda s: 1.0 / (1.0 + s)),
}


def _config(mode: str, budget) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
                            chunk_size=2048 if mode == "hooks" else 16384)


def _values(opt) -> list[tuple]:
    return [(g["lr"], tuple(g["betas"])) for g in opt.param_groups]


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_torch_scheduler_drives_the_engine_like_torch_adamw_and_resumes_exactly(name, mode, tmp_path):
    batches = make_batches("gpt", STEPS)
    budget = pscompile.min_device_memory(make_model("gpt"), batches[0], _config(mode, None), optimizer=HP) + (64 << 10)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # e.g. "lr_scheduler.step() before optimizer.step()"
        ours, theirs = SCHEDULES[name](engine.optimizer), SCHEDULES[name](ref.opt)
        losses, seen = [], []
        for i, b in enumerate(batches):
            if i == SAVE_AT:
                pscompile.save(engine, tmp_path / "run.ckpt", client_state={"scheduler": ours.state_dict(), "next": i})
            assert _values(engine.optimizer) == _values(ref.opt), i
            seen.append(tuple(_values(engine.optimizer)))
            a, c = ref.step(b), engine.step(b)
            assert abs(a - c) <= 1e-5 * abs(a), i
            assert engine.stats.peak_device_bytes <= budget
            losses.append(c)
            ours.step()
            theirs.step()
    assert engine.stats.num_evictions > 0
    assert len(set(seen)) == STEPS, "the schedule did not move the rates every step: proves little"

    resumed = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    again = SCHEDULES[name](resumed.optimizer)
    client = pscompile.load(resumed, tmp_path / "run.ckpt")
    again.load_state_dict(client["scheduler"])
    got = []
    for b in batches[client["next"]:]:
        got.append(resumed.step(b))
        again.step()
    assert got == losses[SAVE_AT:]
    assert _values(resumed.optimizer) == _values(engine.optimizer)
    assert again.state_dict()["last_epoch"] == ours.state_dict()["last_epoch"] == STEPS


def test_the_optimizer_refuses_what_adamw_refuses_and_changes_nothing():
    batches = make_batches("gpt", 2)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config("hooks", None))
    engine.step(batches[0])
    before = engine.state_dict()["master"]
    engine.optimizer.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr=-1.0 must be a finite number >= 0"):
        engine.step(batches[1])
    assert engine.adam.step_count == 1
    assert all(torch.equal(before[k], v) for k, v in engine.state_dict()["master"].items())
    engine.optimizer.param_groups[1]["lr"] = 1e-3
    engine.step(batches[1])
    assert engine.adam.hps[1].lr == 1e-3 == engine.lr
    saved = engine.optimizer.state_dict()
    engine.optimizer.param_groups[0]["lr"] = 7e-4
    engine.optimizer.load_state_dict(saved)
    assert engine.optimizer.param_groups[0]["lr"] == saved["param_groups"][0]["lr"] == engine.adam.hps[0].lr
    wrong = {"param_groups": [dict(g, params=g["params"][:1]) for g in saved["param_groups"]]}
    with pytest.raises(ValueError, match="other parameters.*nothing was loaded"):
        engine.optimizer.load_state_dict(wrong)
    with pytest.raises(ValueError, match="add_param_group"):
        engine.optimizer.add_param_group({"params": []})
    with pytest.raises(ValueError, match="JSON does not hold"):
        pscompile.save(engine, "unused.ckpt", client_state={"scheduler": {"x": torch.zeros(1)}})
