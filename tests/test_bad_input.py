"""Bad batches get the model's own error, in both modes, and lose nothing.

A batch the model rejects (float token ids, a sequence longer than the model allows, an extra
argument, ``None``, a string) raises what eager PyTorch raises for it: the same exception type and
message, in compiled mode too (where the capture runs the forward once more on fake tensors to tell
the batch's fault from a model it cannot trace; a fake kernel may word a dtype differently). The weights, Adam states and the
random number generator stay as they were, and the next good step gives what a clean engine gives.
Models that cannot be captured keep the capture's own advice (``tests/test_capture.py``).
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.runtime.batching import call_model
from conftest import make_batches, make_model

GOOD = make_batches("gpt", 1)[0]
BAD = {
    "float token ids": (GOOD[0].float(), GOOD[1]),
    "longer than seq_len": (torch.cat([GOOD[0], GOOD[0]], 1), torch.cat([GOOD[1], GOOD[1]], 1)),
    "an extra argument": (*GOOD, GOOD[0]),
    "None": None,
    "a string": "hello",
}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _engine(mode: str):
    return pscompile.compile(make_model("gpt", dropout=0.1), GOOD, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=None))


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_a_batch_the_model_rejects_raises_the_models_own_error_and_loses_nothing(mode):
    engine, clean = _engine(mode), _engine(mode)
    for e in (engine, clean):
        torch.manual_seed(1)
        e.step(GOOD)
    before = engine.state_dict()
    for name, bad in BAD.items():
        with pytest.raises(Exception) as eager:
            call_model(make_model("gpt"), bad)
        rng = torch.get_rng_state()
        with pytest.raises(type(eager.value)) as ours:
            engine.step(bad)
        a, b = _first_line(ours.value), _first_line(eager.value)
        # compiled mode finds the error on fake tensors, whose kernels may name a dtype differently
        # ("torch.float32" for "torch.FloatTensor"): the same exception, the same words up to there
        assert a == b or (mode == "compiled" and a[:100] == b[:100]), (name, a, b)
        assert torch.equal(torch.get_rng_state(), rng), name
    after = engine.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(before[key][f], after[key][f]) for f in before[key]), key
    torch.manual_seed(2)
    want = clean.step(GOOD)
    torch.manual_seed(2)
    assert engine.step(GOOD) == want
