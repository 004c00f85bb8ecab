"""Models that checkpoint themselves (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable()``) train in both modes and track plain PyTorch without
checkpointing, under budgets that evict every step.

Compiled mode captures them through autograd and folds the replayed regions back into the forward
(``pscompile.graph.checkpoints``), so a dropout mask is drawn once, as eager PyTorch's RNG restore
makes it; the planner then decides what to recompute (``Config.activations``). Hooks mode runs
them as they are: the replay re-reads parameters during the backward, which the tensor states
(HOLD_AFTER_FWD / HOLD_AFTER_BWD) allow.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import pscompile
from pscompile.graph.capture import capture_joint
from pscompile.testing import ReferenceTrainer, tiny_model
from conftest import TRACKING_TOL, fresh_masters, make_batches, make_model, tracking_of

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
HAVE_HF = importlib.util.find_spec("transformers") is not None


class CheckpointedGPT(torch.nn.Module):
    """pscompile's GPT with every block run under ``torch.utils.checkpoint`` (same parameters, same
    math: the reference trains the plain GPT)."""

    def __init__(self, gpt, use_reentrant: bool = False):
        super().__init__()
        self.gpt, self.use_reentrant = gpt, use_reentrant

    def forward(self, idx, targets):
        g = self.gpt
        x = g.drop(g.wte(idx) + g.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in g.h:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _config(mode: str, budget=None) -> pscompile.Config:
    return pscompile.Config(mode=mode, backend="eager", device="cpu", dtype=torch.float32, device_memory=budget)


def _train_against_plain(make, plain, batches, mode: str, initial, strip: str = ""):
    """Train ``make()`` at its minimum budget next to plain PyTorch on ``plain()``; per-step checks."""
    least = pscompile.min_device_memory(make(), batches[0], _config(mode))
    engine = pscompile.compile(make(), batches[0], optimizer=HP, config=_config(mode, least))
    ref = ReferenceTrainer(plain(), optimizer=HP, dtype=torch.float32)
    evictions = 0
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        want = ref.step(b)
        torch.manual_seed(100 + i)
        got = engine.step(b)
        assert abs(got - want) <= 1e-5 * abs(want), (i, got, want)
        assert engine.stats.peak_device_bytes <= least
        evictions += engine.stats.num_evictions
    assert evictions > 0, "the minimum budget must evict"
    ours = {k.removeprefix(strip): v for k, v in engine.state_dict()["master"].items()}
    worst, name = tracking_of(ours, ref, initial)
    assert worst <= TRACKING_TOL, name
    return engine


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_gpt_that_checkpoints_its_blocks_tracks_plain_pytorch(mode, reentrant):
    batches = make_batches("gpt", 5)
    engine = _train_against_plain(lambda: CheckpointedGPT(make_model("gpt", dropout=0.1), reentrant),
                                  lambda: make_model("gpt", dropout=0.1), batches, mode,
                                  fresh_masters("gpt", torch.float32, dropout=0.1), strip="gpt.")
    if mode == "compiled":
        assert engine.schedule.scheduled.activations is not None


def test_the_replayed_regions_are_folded_into_the_forward():
    """The capture of the checkpointed GPT draws its dropout masks exactly as often as the plain
    GPT's: once per dropout, not again in the backward."""
    def random_ops(model) -> int:
        batch = make_batches("gpt", 1)[0]
        captured = capture_joint(model, batch, params=dict(model.named_parameters()))
        return sum(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in captured.gm.graph.nodes)

    plain = random_ops(make_model("gpt", dropout=0.1))
    assert plain == 1 + 2 * 3, plain      # the embedding's, and per block attention, its projection, the MLP
    assert random_ops(CheckpointedGPT(make_model("gpt", dropout=0.1))) == plain
    assert random_ops(CheckpointedGPT(make_model("gpt", dropout=0.1), use_reentrant=True)) == plain


@pytest.mark.skipif(not HAVE_HF, reason="needs transformers (the hf extra)")
@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_gradient_checkpointing_tracks_plain_pytorch(mode, reentrant):
    def checkpointed():
        model, _ = tiny_model("hf-gpt2")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model.train()

    _, batch = tiny_model("hf-gpt2")
    initial = {k: v.detach().clone() for k, v in ReferenceTrainer(tiny_model("hf-gpt2")[0], optimizer=HP,
                                                                    dtype=torch.float32).master_state().items()}
    _train_against_plain(checkpointed, lambda: tiny_model("hf-gpt2")[0].train(), [batch] * 3, mode, initial)
