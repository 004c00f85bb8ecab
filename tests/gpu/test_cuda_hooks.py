"""CUDA-only checks: pinned host chunks, allocator-based measurement, parity on the GPU."""

import pytest
import torch

import pscompile
from pscompile.testing import ReferenceTrainer
from pscompile.models.gpt import GPT, gpt_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_parity_under_a_tight_budget(dtype):
    batches = _batches(6)
    hp = pscompile.AdamW(lr=1e-3)
    torch.manual_seed(0)
    ref = ReferenceTrainer(GPT(gpt_config("gpt-tiny")), optimizer=hp, dtype=dtype, device="cuda")
    torch.manual_seed(0)
    probe = pscompile.compile(GPT(gpt_config("gpt-tiny")), batches[0], optimizer=hp,
                              config=pscompile.Config(mode="hooks", device="cuda", dtype=dtype, chunk_size=4096,
                                                      device_memory="1GiB"))
    budget = probe.min_device_memory + 3 * 4096 * torch.empty((), dtype=dtype).element_size()
    probe.close()
    del probe
    torch.manual_seed(0)
    engine = pscompile.compile(GPT(gpt_config("gpt-tiny")), batches[0], optimizer=hp,
                               config=pscompile.Config(mode="hooks", device="cuda", dtype=dtype, chunk_size=4096,
                                                       device_memory=budget))
    homes = [c for c in range(engine.layout.num_chunks) if not engine.store.device_homed(c)]
    assert homes and all(engine.store.host_param[c].is_pinned() for c in homes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b in batches:
        a, r = engine.step(b), ref.step(b)
        assert abs(a - r) <= tol * abs(r)
        assert engine.stats.peak_device_bytes <= budget
        assert engine.stats.num_evictions > 0
