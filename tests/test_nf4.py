"""NF4 (``pscompile/memory/nf4.py``): the levels come back exactly, every element lands on its nearest
level, odd sizes and short last blocks keep their values, and the format is bitsandbytes' own
(codes, statistics and dequantized values equal both ways, where bitsandbytes is installed)."""

from __future__ import annotations

import pytest
import torch

from pscompile.memory.nf4 import LEVELS, Quantized, dequantize, quantize


def _sample(n: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 3).to(dtype)


def test_each_level_times_its_block_absmax_comes_back_exactly():
    levels = torch.tensor(LEVELS)
    x = torch.cat([levels * 2.5, levels.flip(0) * 0.125, levels[:8] * 7.0])     # blocks of 16, the last short
    q = quantize(x, block=16)
    assert torch.equal(q.absmax, torch.tensor([2.5, 0.125, 7.0]))
    assert torch.equal(dequantize(q), x)
    assert torch.equal(quantize(dequantize(q), block=16).codes, q.codes)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4097])
def test_every_element_takes_its_nearest_level(n):
    x = _sample(n, seed=n)
    q = quantize(x)
    y = dequantize(q)
    assert y.shape == x.shape and q.codes.numel() == (n + 1) // 2 and q.absmax.numel() == -(-n // 64)
    absmax = q.absmax.repeat_interleave(64)[:n]
    candidates = torch.tensor(LEVELS)[None, :] * absmax[:, None]
    best = (candidates - x[:, None]).abs().amin(dim=1)
    assert torch.allclose((y - x).abs(), best, atol=1e-6, rtol=1e-5)
    assert q.nbytes == (n + 1) // 2 + 4 * -(-n // 64)


def test_shapes_dtypes_and_an_all_zero_block():
    x = torch.zeros(3, 70, dtype=torch.bfloat16)
    x[2] = _sample(70, dtype=torch.bfloat16)
    q = quantize(x)
    assert q.shape == x.shape and q.absmax[0] == 0
    y = dequantize(q, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 70) and not y[0].any()
    assert dequantize(q).dtype == torch.float32


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="floating-point.*torch.int64"):
        quantize(torch.arange(8))
    with pytest.raises(ValueError, match="block must be an even number"):
        quantize(torch.ones(8), block=3)


def test_the_format_is_bitsandbytes_own_both_ways():
    bnb = pytest.importorskip("bitsandbytes.functional")
    for n, seed in ((4096, 1), (1000, 2), (64 * 37 + 2, 3)):
        x = _sample(n, seed=seed)
        theirs, state = bnb.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=False)
        ours = quantize(x)
        assert torch.equal(ours.absmax, state.absmax.float())
        assert torch.equal(ours.codes, theirs.reshape(-1)), (ours.codes != theirs.reshape(-1)).sum()
        assert torch.equal(dequantize(ours), bnb.dequantize_4bit(theirs, state).reshape(-1))
        # theirs read here: their codes and statistics dequantize to their values
        back = Quantized(theirs.reshape(-1), state.absmax.float(), x.shape)
        assert torch.equal(dequantize(back), bnb.dequantize_4bit(theirs, state).reshape(-1))
