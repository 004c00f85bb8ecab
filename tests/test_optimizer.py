"""ChunkAdamW equals torch.optim.AdamW on the same numbers; gradless ranges are untouched."""

import pytest
import torch

from pscompile.config import AdamW
from pscompile.optim.adamw import ChunkAdamW, LossScaler, clip_coefficient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_update_matches_torch_adamw(dtype):
    torch.manual_seed(0)
    hp = AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sizes = [300, 200, 500]
    chunk = 1024
    masters = [torch.randn(n) for n in sizes]
    ref_params = [m.clone().requires_grad_(True) for m in masters]
    opt = torch.optim.AdamW(ref_params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    master = torch.zeros(chunk)
    master[:1000] = torch.cat(masters)
    exp_avg, exp_avg_sq = torch.zeros(chunk), torch.zeros(chunk)
    param = master.to(dtype, copy=True)   # separate buffers, as in the chunk store
    adam = ChunkAdamW(hp)
    for step in range(5):
        grads = [torch.randn(n).to(dtype) for n in sizes]
        for p, g in zip(ref_params, grads):
            p.grad = g.float()
        opt.step()
        param[:1000] = torch.cat(grads)       # the gradient overwrites the param chunk
        adam.begin_step()
        adam.update_chunk(param, master, exp_avg, exp_avg_sq, grad_factor=1.0, gradless=[])
        ours = torch.split(master[:1000], sizes)
        for o, r in zip(ours, ref_params):
            torch.testing.assert_close(o, r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(param, master.to(dtype))
        assert torch.count_nonzero(master[1000:]) == 0  # padding stays zero


def test_gradless_ranges_are_skipped_like_grad_none():
    hp = AdamW(lr=1e-2, weight_decay=0.5)
    master = torch.randn(64)
    before = master.clone()
    exp_avg, exp_avg_sq = torch.zeros(64), torch.zeros(64)
    param = torch.randn(64)   # "gradients"
    adam = ChunkAdamW(hp)
    adam.begin_step()
    adam.update_chunk(param, master, exp_avg, exp_avg_sq, grad_factor=1.0, gradless=[(10, 6)])
    assert torch.equal(master[10:16], before[10:16])         # no decay, no update
    assert torch.count_nonzero(exp_avg[10:16]) == 0
    assert not torch.equal(master[:10], before[:10])
    assert torch.equal(param[10:16], before[10:16])          # param restored from master


def test_grad_factor_equals_scaled_gradient():
    hp = AdamW(lr=1e-3, weight_decay=0.0)
    g = torch.randn(100)
    outs = []
    for factor, grad in ((0.25, g.clone()), (1.0, g * 0.25)):
        master, ea, eas = torch.ones(100), torch.zeros(100), torch.zeros(100)
        adam = ChunkAdamW(hp)
        adam.begin_step()
        adam.update_chunk(grad, master, ea, eas, grad_factor=factor, gradless=[])
        outs.append((master, ea, eas))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_loss_scaler_follows_gradscaler_rules():
    s = LossScaler(scale=1024.0, growth_interval=3)
    s.update(True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(False)
    assert s.scale == 1024.0 and s.good_steps == 0


def test_clip_coefficient():
    assert clip_coefficient(10.0, None) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)


def test_blocked_16bit_update_equals_one_block(monkeypatch):
    """A 16-bit gradient is updated block by block (``UPDATE_BLOCK``) on the CPU and a range at a
    time on a GPU; the kernel is elementwise, so any block size gives the same bits, and every element of the param chunk -- gradless ranges,
    elements of no group, padding -- ends as the cast of its master."""
    import pscompile.optim.adamw as adamw

    torch.manual_seed(0)
    hp = [AdamW(lr=1e-2, weight_decay=0.1), AdamW(lr=3e-3, weight_decay=0.0)]
    groups = [(0, [(0, 300), (700, 250)]), (1, [(400, 200)])]     # 300-400, 600-700, 950+ : no group
    master0 = torch.randn(1024)
    master0[950:] = 0
    grad = torch.randn(1024).bfloat16()
    results = []
    # blocks of 64, 1000, 2^20 (the CPU's blocking), and whole ranges (a GPU's: one kernel call per
    # range, for the launches a 1.2B-parameter model's 64Ki-element blocks cost on an H200)
    for block, blocked in ((64, True), (1000, True), (1 << 20, True), (64, False)):
        monkeypatch.setattr(adamw, "UPDATE_BLOCK", block)
        master, ea, eas = master0.clone(), torch.zeros(1024), torch.zeros(1024)
        param = grad.clone()                     # the gradient over the param chunk
        adam = ChunkAdamW(hp, blocked=blocked)
        adam.begin_step()
        adam.update_chunk(param, master, ea, eas, grad_factor=0.5, gradless=[(100, 30), (720, 10)], groups=groups)
        assert torch.equal(param, master.bfloat16())
        assert torch.equal(master[100:130], master0[100:130]) and torch.equal(master[300:400], master0[300:400])
        results.append((master, ea, eas))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
