"""float16 in compiled mode: dynamic loss scaling inside the captured graph, as hooks mode and plain
PyTorch's ``GradScaler``-style run do it.

The loss scale is an input of the graph (``loss * scale`` computed as eager computes it, in fp32
and rounded to the loss's dtype), so the backward sees scaled gradients: at an initial scale of
2**24 the scaled gradients overflow float16, the step is skipped with weights and Adam states
untouched, and the scale halves until they fit. Tiny GPT (float16 matmuls are slow on this CPU).
"""

from __future__ import annotations

import torch

import pscompile
from pscompile.testing import ReferenceTrainer
from conftest import make_batches, make_model

HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
STEPS = 8
SCALE = 2.0 ** 24              # high enough that the first scaled gradients overflow float16


def _run(mode: str | None, budget=None, accumulate: bool = False):
    """Losses, skipped flags and loss scales per step: pscompile in ``mode``, or plain PyTorch (None)."""
    batches = make_batches("gpt", STEPS, batch=2, seq=32)
    steps = [[b, b] if accumulate else b for b in batches]
    if mode is None:
        ref = ReferenceTrainer(make_model("gpt", n_layer=1), optimizer=HP, dtype=torch.float16,
                               initial_loss_scale=SCALE)
        out = []
        for s in steps:
            scale = ref.scaler.scale
            loss = ref.step(s)
            out.append((loss, ref.scaler.scale < scale, scale))
        return out, {n: m.detach().clone() for n, m in zip(
            [n for n, _ in ref.model.named_parameters()], ref.master)}
    engine = pscompile.compile(make_model("gpt", n_layer=1), batches[0], optimizer=HP, config=pscompile.Config(
        mode=mode, backend="eager", device="cpu", dtype=torch.float16, device_memory=budget,
        initial_loss_scale=SCALE))
    out = []
    for s in steps:
        before = engine.state_dict()["master"] if not out or out[-1][1] else None
        loss = engine.step(s)
        st = engine.stats
        out.append((loss, st.skipped, st.loss_scale))
        if st.skipped and before is not None:           # a skipped step touches no weight
            after = engine.state_dict()["master"]
            assert all(torch.equal(before[f], after[f]) for f in before)
        if budget is not None:
            assert st.peak_device_bytes <= budget
    return out, engine.state_dict()["master"]


def test_compiled_float16_skips_overflows_and_tracks_plain_pytorch():
    ref, ref_w = _run(None)
    ours, w = _run("compiled")
    hooks, _ = _run("hooks")
    skipped = [s for _, s, _ in ref]
    assert skipped[0] and not skipped[-1], "the first scale overflows float16, a later one fits"
    assert ours == hooks                                  # the same skips, scales and losses
    assert [s for _, s, _ in ours] == skipped and [c for _, _, c in ours] == [c for _, _, c in ref]
    for (a, _, _), (b, _, _) in zip(ours, ref):
        assert abs(a - b) <= 2e-2 * abs(b), (ours, ref)
    for f, t in ref_w.items():
        assert (w[f] - t).abs().max() <= 5e-2 * max(1.0, t.abs().max()), f


def test_compiled_float16_accumulation_scales_each_micro_batch_as_hooks_mode_does():
    """Two micro-batches per step, each loss scaled by scale / 2 in the graph, their gradients
    summed in fp32 on the host: the same skips, scales and losses as hooks mode. (Plain PyTorch
    sums the micro-batches' gradients in float16, where the sum overflows one step later.)"""
    ours, _ = _run("compiled", accumulate=True)
    hooks, _ = _run("hooks", accumulate=True)
    assert ours == hooks
    assert ours[0][1] and not ours[-1][1]


def test_compiled_float16_under_a_budget_that_evicts():
    least = pscompile.min_device_memory(make_model("gpt", n_layer=1), make_batches("gpt", 1, batch=2, seq=32)[0],
                                        pscompile.Config(mode="compiled", backend="eager", device="cpu",
                                                         dtype=torch.float16))
    ref, _ = _run(None)
    ours, _ = _run("compiled", budget=least)
    assert [s for _, s, _ in ours] == [s for _, s, _ in ref]
