"""CUDA-only: compiled regions measured on the inputs they really receive (compiled/probe.py).

On a GPU a region run on made-up indices is an out-of-bounds access or a device-side assert that
ends the CUDA context; here a model gathers at positions computed from values an earlier region
made, under an evicting budget, through Inductor on the GPU, and tracks plain PyTorch there.
"""

import pytest
import torch

import pscompile
from pscompile.testing import ReferenceTrainer, routed_gather

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    return routed_gather()[0]


def test_cuda_regions_measured_on_real_inputs_track_plain_pytorch():
    batch = routed_gather()[1]
    hp = pscompile.AdamW(lr=1e-3)
    config = pscompile.Config(mode="compiled", backend="inductor", device="cuda", dtype=torch.float32,
                              chunk_size=1024)
    minimum = pscompile.min_device_memory(_model(), batch, config)
    budget = 3 * minimum                     # evicting, with room for the regions' measured peaks
    ref = ReferenceTrainer(_model(), optimizer=hp, dtype=torch.float32, device="cuda")
    engine = pscompile.compile(_model(), batch, optimizer=hp,
                               config=pscompile.Config(mode="compiled", backend="inductor", device="cuda",
                                                       dtype=torch.float32, chunk_size=1024, device_memory=budget))
    for step in range(4):
        ours, plain = engine.step(batch), ref.step(batch)
        assert abs(ours - plain) <= 1e-5 * abs(plain), (step, ours, plain)
        assert engine.stats.peak_device_bytes <= budget
    assert engine.stats.num_evictions > 0
    assert engine._allocs and not engine._region_cache.failures("inductor")
    engine.close()
