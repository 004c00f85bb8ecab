"""Non-finite gradients without loss scaling (float32, bfloat16), in both modes: the step raises
``FloatingPointError`` (or, with ``Config(skip_nonfinite=True)``, is skipped and reported so), the
weights, Adam states and step count stay as they were, and the next good step gives what it would
have given had the bad one never happened."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pscompile
from conftest import same_state, snapshot


class _Weighted(nn.Module):
    """Two layers and a loss multiplied by a batch tensor: a weight of inf poisons the gradients."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, w):
        return (self.b(torch.relu(self.a(x))) ** 2).mean() * w


def _engine(mode: str, dtype: torch.dtype, **kw):
    torch.manual_seed(0)
    batch = (torch.randn(8, 16).to(dtype), torch.tensor(1.0, dtype=dtype))
    return pscompile.compile(_Weighted(), batch, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=dtype, **kw)), batch




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_nonfinite_gradients_raise_or_skip_and_touch_nothing(mode, dtype):
    engine, good = _engine(mode, dtype)
    skipping, _ = _engine(mode, dtype, skip_nonfinite=True)
    clean, _ = _engine(mode, dtype)
    for e in (engine, skipping, clean):
        e.step(good)
    for bad_w in (float("inf"), float("nan")):
        bad = (good[0], torch.tensor(bad_w, dtype=dtype))
        before = snapshot(engine)
        with pytest.raises(FloatingPointError, match="inf/NaN .* the update was not applied"):
            engine.step(bad)
        assert same_state(snapshot(engine), before)
        before = snapshot(skipping)
        skipping.step(bad)
        assert skipping.stats.skipped and same_state(snapshot(skipping), before)
    want = clean.step(good)                       # as if the bad steps had never happened
    assert engine.step(good) == want == skipping.step(good)
    assert same_state(snapshot(engine), snapshot(clean)) and same_state(snapshot(skipping), snapshot(clean))
    assert not skipping.stats.skipped


def test_skip_nonfinite_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_nonfinite='yes' must be True or False"):
        pscompile.Config(skip_nonfinite="yes")
