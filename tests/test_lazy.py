"""``pscompile.compile(model)`` without a batch (pscompile/lazy.py): built at the first step, it
trains step for step like ``compile(model, batch)`` in both modes under a budget that evicts, with a
scheduler and a checkpoint set up before that step; what needs the batch fails there, clearly."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler as sched

import pscompile
from conftest import make_batches, make_model

HP = pscompile.AdamW(lr=3e-3, weight_decay=0.1, param_groups=[
    {"params": lambda name, p: p.ndim < 2, "weight_decay": 0.0}])


def _config(mode: str, budget) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget,
                            chunk_size=2048 if mode == "hooks" else 16384)


def _warmup(opt):
    return sched.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 6))   # still rising when the run resumes


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_the_lazy_form_trains_like_the_batch_first_form_and_resumes_from_a_checkpoint_loaded_before_it_is_built(
        mode, tmp_path):
    batches = make_batches("gpt", 5)
    budget = pscompile.min_device_memory(make_model("gpt"), batches[0], _config(mode, None), optimizer=HP) + (64 << 10)
    eager = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config(mode, budget))
    lazy = pscompile.compile(make_model("gpt"), optimizer=HP, config=_config(mode, budget))
    assert lazy.built is None and len(lazy.optimizer.param_groups) == 2
    s_eager, s_lazy = _warmup(eager.optimizer), _warmup(lazy.optimizer)   # set up before the first step
    losses = []
    for i, b in enumerate(batches):
        if i == 2:
            pscompile.save(lazy, tmp_path / "run.ckpt", client_state={"scheduler": s_lazy.state_dict(), "next": i})
        a, c = eager.step(b), lazy.step(b)
        assert a == c, i
        assert lazy.stats.peak_device_bytes <= budget
        losses.append(c)
        s_eager.step()
        s_lazy.step()
    assert lazy.stats.num_evictions > 0
    assert lazy.optimizer is lazy.built.optimizer, "the scheduler drives an optimizer the engine no longer reads"
    assert lazy.param_groups == eager.param_groups

    resumed = pscompile.compile(make_model("gpt"), optimizer=HP, config=_config(mode, budget))
    s_resumed = _warmup(resumed.optimizer)
    client = pscompile.load(resumed, tmp_path / "run.ckpt")        # checked now, loaded at the first step
    assert resumed.built is None
    s_resumed.load_state_dict(client["scheduler"])
    got = []
    for b in batches[client["next"]:]:
        got.append(resumed.step(b))
        s_resumed.step()
    assert got == losses[2:]
    for e in (eager, lazy, resumed):
        e.close()


def test_before_the_first_step(tmp_path):
    batch = make_batches("gpt", 1)[0]
    model = make_model("gpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lazy = pscompile.compile(model, config=_config("hooks", None))
    with pytest.raises(AttributeError, match=r"engine.stats: .*built at its first step\(batch\)"):
        lazy.stats
    assert not hasattr(lazy, "layout")
    with pytest.raises(RuntimeError, match="pscompile.save: .* not been built yet"):
        pscompile.save(lazy, tmp_path / "x.ckpt")
    with lazy.materialize() as m:             # the model still holds its own weights
        assert m is model and all(torch.equal(weights[k], v) for k, v in m.state_dict().items())
    lazy.lr = 1e-4
    with pytest.raises(ValueError, match="lr=-1"):
        lazy.set_lr(-1)
    assert lazy.lr == 1e-4 and lazy.param_groups[-1]["lr"] == 1e-4
    (tmp_path / "bad.ckpt").write_bytes(b"PSCKPT03" + b"\0" * 64)
    with pytest.raises(ValueError, match="nothing was loaded"):
        pscompile.load(lazy, tmp_path / "bad.ckpt")                   # refused at once, not at the first step
    lazy.close()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items()), "close() before a step moved weights"
    with pytest.raises(RuntimeError, match="closed"):
        lazy.step(batch)


def test_the_budget_error_moves_to_the_first_step_and_leaves_the_model_whole():
    batch = make_batches("gpt", 1)[0]
    model = make_model("gpt")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lazy = pscompile.compile(model, config=_config("compiled", 4096))
    with pytest.raises(pscompile.BudgetError, match="give device_memory >="):
        lazy.step(batch)
    assert lazy.built is None
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    ok = pscompile.compile(model, config=_config("compiled", None))    # the model was not left held
    assert ok.step(batch) > 0
    assert lazy.built is None and ok.built is not None


@pytest.mark.parametrize("first", ["evaluate", "micro-batches"])
def test_the_engine_is_built_by_whichever_call_comes_first(first):
    """Built by ``evaluate`` or by a list of micro-batches, the lazy engine then trains exactly as
    the batch-first form does."""
    batches = make_batches("gpt", 3)
    eager = pscompile.compile(make_model("gpt"), batches[0], optimizer=HP, config=_config("hooks", None))
    lazy = pscompile.compile(make_model("gpt"), optimizer=HP, config=_config("hooks", None))
    if first == "evaluate":
        assert lazy.evaluate(batches[0]) == eager.evaluate(batches[0])
        assert lazy.step(batches[1]) == eager.step(batches[1])
    else:
        micro = [tuple(t[:1] for t in batches[1]), tuple(t[1:] for t in batches[1])]
        assert lazy.step(micro) == eager.step(micro)
    assert lazy.step(batches[2]) == eager.step(batches[2])
