"""Parameter groups: ``AdamW(param_groups=...)`` trains like ``torch.optim.AdamW`` given the same
groups, in both modes under a budget that evicts; groups are resolved by name (tied names too)
or predicate, wrong groups are refused by name, and the groups' values are saved and loaded.

Sharded runs (tests/test_dist.py) and the exact-resume runs (tests/test_checkpoint.py) train with
parameter groups too (``HP`` in their workers)."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.testing import ReferenceTrainer
from conftest import TRACKING_TOL, fresh_masters, make_batches, make_model, max_weight_diff, worst_tracking

# no weight decay and a smaller rate on biases and norms, and a rate of its own for the tied
# embedding (named by its tied name); a large decay so that a group applied wrongly shows
HP = pscompile.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.5, param_groups=[
    {"params": lambda name, p: p.ndim < 2, "weight_decay": 0.0, "lr": 1e-3},
    {"params": ["lm_head.weight"], "lr": 5e-3, "betas": (0.8, 0.9)}])


def _config(mode: str, budget) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
                            chunk_size=2048 if mode == "hooks" else 16384)   # chunks hold several groups


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_groups_train_like_torch_adamw_with_the_same_groups(mode):
    batches = make_batches("gpt", 5)
    least = pscompile.min_device_memory(make_model("gpt"), batches[0], _config(mode, None), optimizer=HP)
    budget = least + (64 << 10)
    engine = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    ref = ReferenceTrainer(make_model("gpt"), optimizer=HP, dtype=torch.float32)
    assert [g["params"] for g in ref.opt.param_groups][1] == [ref.master[0]]   # the tied embedding, by its alias
    for b in batches:
        a, c = ref.step(b), engine.step(b)
        assert abs(a - c) <= 1e-5 * abs(a)
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
    assert max_weight_diff(engine, ref) <= 1e-4
    assert worst_tracking(engine, ref, fresh_masters("gpt", torch.float32))[0] <= TRACKING_TOL
    # the groups differ from one group: a run that ignored them would not have tracked the reference
    flat = ReferenceTrainer(make_model("gpt"), optimizer=pscompile.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.5),
                            dtype=torch.float32)
    for b in batches:
        flat.step(b)
    assert max((flat.master_state()[k] - ref.master_state()[k]).abs().max().item() for k in ref.master_state()) > 1e-3


def test_groups_are_resolved_in_torch_order():
    engine = pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], optimizer=HP, config=_config("hooks", None))
    groups = engine.param_groups
    assert len(groups) == 3
    names = dict(make_model("gpt").named_parameters())
    assert groups[0]["params"] == [n for n, p in names.items() if p.ndim < 2]
    assert groups[1]["params"] == ["wte.weight"] and groups[1]["betas"] == (0.8, 0.9)
    assert groups[2]["params"] == [n for n, p in names.items() if p.ndim >= 2 and n != "wte.weight"]
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-3, 0.0), (5e-3, 0.5), (3e-3, 0.5)]
    engine.set_lr(2e-3, group=1)
    assert [g["lr"] for g in engine.param_groups] == [1e-3, 2e-3, 3e-3]
    engine.lr = 1e-4                                   # a schedule's value: every group
    assert [g["lr"] for g in engine.param_groups] == [1e-4] * 3
    with pytest.raises(ValueError, match="group=3 is not a parameter group; this engine has 3"):
        engine.set_lr(1e-3, group=3)


@pytest.mark.parametrize("groups, message", [
    ([{"params": ["h.0.attn.c_attn.wieght"]}], r"param_groups\[0\] names 'h.0.attn.c_attn.wieght', which the model "
                                                r"does not have"),
    ([{"params": ["ln_f.bias"]}, {"params": lambda n, p: p.ndim < 2}], r"param_groups\[1\] names \['ln_f.bias'\], "
                                                                        r"already in param_groups\[0\]"),
    ([{"params": lambda n, p: "bias"}], r"must return True or False, it returned 'bias'"),
])
def test_wrong_groups_are_refused_by_name(groups, message):
    with pytest.raises(ValueError, match=message):
        pscompile.compile(make_model("gpt"), make_batches("gpt", 1)[0], optimizer=pscompile.AdamW(param_groups=groups),
                          config=_config("hooks", None))


@pytest.mark.parametrize("groups, message", [
    ([{"params": ["a"], "amsgrad": True}], r"param_groups\[0\] has keys \['amsgrad'\]"),
    ([{"lr": 1e-3}], r"param_groups\[0\] has no 'params'"),
    ([{"params": [torch.zeros(2)]}], r"param_groups\[0\]\['params'\] must be parameter names"),
    ([{"params": ["a"], "lr": -1.0}], r"lr=-1.0 must be a finite number >= 0"),
    ({"params": ["a"]}, r"param_groups=.* must be a list of dicts"),
    ([("a", 1e-3)], r"param_groups\[0\] is a tuple"),
])
def test_bad_group_values_name_the_field(groups, message):
    with pytest.raises(ValueError, match=message):
        pscompile.AdamW(param_groups=groups)


def test_group_values_are_saved_and_loaded(tmp_path):
    batch = make_batches("gpt", 1)[0]
    engine = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=_config("hooks", None))
    engine.step(batch)
    engine.set_lr(7e-4, group=0)                       # a schedule moved it: the checkpoint carries it
    pscompile.save(engine, tmp_path / "g.ckpt")
    fresh = pscompile.compile(make_model("gpt"), batch, optimizer=HP, config=_config("hooks", None))
    pscompile.load(fresh, tmp_path / "g.ckpt")
    assert fresh.param_groups == engine.param_groups
    other = pscompile.compile(make_model("gpt"), batch, config=_config("hooks", None))   # one group
    before = other.state_dict()
    with pytest.raises(ValueError, match="holds other parameters than this engine's groups"):
        pscompile.load(other, tmp_path / "g.ckpt")
    after = other.state_dict()
    assert all(torch.equal(before["master"][k], after["master"][k]) for k in before["master"])
