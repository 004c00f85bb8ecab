"""CUDA-only: the budget kept by the caching allocator's own count, at every step, with compiled
regions (issue "Compiled code at every budget"; the CPU twins are tests/test_regions_fit.py).

- a region cut to fit: at 1.15x the named minimum the default backend runs compiled code for most
  operators (regions cut to fit the plan, never the whole capture node by node), within the budget;
- the probing steps within the budget by the allocator's count: the step that measures the
  compiled regions (device copies of their inputs, the regions' own allocations) keeps
  ``StepStats.allocator_peak_bytes`` within the budget, as every other step does;
- the minimum kept: ``min_device_memory``'s answer trains every step on CUDA (cuBLAS workspaces made
  before anything is measured, ``memory.tracker.warm_device_libraries``), by the allocator's count.
"""

import pytest
import torch

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = 7


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=512, seq_len=64))


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))


def _config(budget=None, dtype=torch.float32):
    return pscompile.Config(mode="compiled", device="cuda", dtype=dtype, device_memory=budget)


def _train(factor: float, dtype=torch.float32):
    """Every step's peaks, ours and the allocator's, within the budget; returns (engine, stats)."""
    batch = _batch()
    budget = int(pscompile.min_device_memory(_model(), batch, _config(dtype=dtype)) * factor)
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(_model(), optimizer=hp, dtype=dtype, device="cuda")
    engine = pscompile.compile(_model(), batch, optimizer=hp, config=_config(budget, dtype))
    stats = []
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(STEPS):
        ours, plain = engine.step(batch), ref.step(batch)
        s = engine.stats
        stats.append(s)
        assert abs(ours - plain) <= tol * abs(plain), (step, ours, plain)
        assert s.peak_device_bytes <= budget, (step, s.peak_device_bytes, budget)
        assert s.allocator_peak_bytes is not None and s.allocator_peak_bytes <= budget, \
            (step, s.allocator_peak_bytes, budget)
    return engine, stats


def test_cuda_one_program_at_a_tight_budget():
    """From the second step on, one Inductor program per schedule, within the budget by the
    allocator's count every step (``_train``), or compiled eager with the reason said."""
    engine, stats = _train(1.15)
    assert stats[-1].compiled_share == 1.0 or any(c.eager_reason for c in engine.captures()), \
        [s.compiled_share for s in stats]
    engine.close()


def test_cuda_the_first_compiled_step_is_within_the_budget_by_the_allocators_count():
    """The first program step is checked before it runs (Inductor's buffer plan); _train checks
    the allocator's peak on it and every later step."""
    engine, stats = _train(1.3)
    assert stats[0].compiled_ops == 0 and stats[1].compiled_share == 1.0, [s.compiled_share for s in stats]
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_named_minimum_trains_every_step(dtype):
    engine, stats = _train(1.0, dtype)
    assert stats[-1].num_evictions > 0
    engine.close()
