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


def _freeze_block_weights(model):
    """Every weight inside a block frozen (layer norms' and projections'); embeddings, head and
    biases trained: what a frozen base under an adapter looks like to a replay."""
    for name, p in model.named_parameters():
        if ".h." in f".{name}" and name.endswith("weight"):
            p.requires_grad_(False)
    return model


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_gpt_with_frozen_weights_tracks_plain_pytorch(mode, reentrant):
    """The replay re-reads frozen weights: non-reentrant checkpointing keeps a frozen parameter
    itself for the region's backward (a trainable one as a view), so hooks mode must keep what
    the replay read until that backward is over (it gave NaN gradients once)."""
    batches = make_batches("gpt", 4)
    initial = {k: v for k, v in fresh_masters("gpt", torch.float32, dropout=0.1).items()
               if not (k.startswith("h.") and k.endswith("weight"))}
    _train_against_plain(lambda: _freeze_block_weights(CheckpointedGPT(make_model("gpt", dropout=0.1), reentrant)),
                         lambda: _freeze_block_weights(make_model("gpt", dropout=0.1)), batches, mode,
                         initial, strip="gpt.")


class _RegionBackwardEnds(torch.autograd.Function):
    """Identity whose backward, the last of its region's (it is the region's first operation),
    calls ``probe()``."""

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.probe()
        return grad, None


def test_hooks_mode_keeps_what_a_replay_read_on_the_device_until_its_region_backward_ends():
    """Non-reentrant checkpointing hands the region's backward nodes what the replay saved: views
    of chunks (a trainable parameter) and the parameters themselves (a frozen one), behind hooks
    mode's back. Their chunks must stay on the device, holding those values, until the region's
    last backward node has run; the trace, which evicts every chunk nothing pins, included."""
    model = _freeze_block_weights(CheckpointedGPT(make_model("gpt")))
    seen, live = [], {}

    def probe(block):
        def check():
            if "engine" not in live:        # (min_device_memory's own engine)
                return
            engine = live["engine"]
            chunks = {c for n, _ in block.named_parameters() for c in engine.layout.entry(f"{prefix[block]}.{n}").chunks}
            seen.append(all(engine.store.resident(c) for c in chunks))
        return check

    prefix = {b: f"gpt.h.{i}" for i, b in enumerate(model.gpt.h)}
    checks = {b: probe(b) for b in model.gpt.h}

    def forward(idx, targets):
        g = model.gpt
        x = g.drop(g.wte(idx) + g.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in g.h:
            x = checkpoint(lambda y, b=block: b(_RegionBackwardEnds.apply(y, checks[b])), x, use_reentrant=False)
        logits = g.lm_head(g.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    model.forward = forward
    batch = make_batches("gpt", 1)[0]
    least = pscompile.min_device_memory(model, batch, _config("hooks"))
    engine = live["engine"] = pscompile.compile(model, batch, optimizer=HP, config=_config("hooks", least))
    for _ in range(2):
        engine.step(batch)
        assert engine.stats.peak_device_bytes <= least
    assert seen and all(seen), seen


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
