"""CUDA-only: chunk updates in the backward (``Config.overlap_update``) on a GPU, where the backward
runs on the device and the host's update thread reads each chunk's gradients once its writeback
on the copy stream has landed (the event waited for on the host): bit-identical to updating
after the backward, under an evicting budget, in bf16 with a clip that never bites."""

import pytest
import torch

import pscompile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    from pscompile.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=4096, seq_len=64))


def test_cuda_updates_in_the_backward_are_bit_identical():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 4096, (2, 64), generator=g), torch.randint(0, 4096, (2, 64), generator=g))
               for _ in range(4)]
    hp = pscompile.AdamW(lr=1e-3, max_grad_norm=100.0)
    base = dict(mode="compiled", backend="eager", device="cuda", dtype=torch.bfloat16, chunk_size=1 << 14)
    budget = pscompile.min_device_memory(_model(), batches[0], pscompile.Config(**base)) + 2 * (1 << 15)
    runs = []
    for overlap in (False, True):
        engine = pscompile.compile(_model(), batches[0], optimizer=hp,
                                   config=pscompile.Config(**base, device_memory=budget, overlap_update=overlap))
        losses = [engine.step(b) for b in batches]
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
        runs.append((losses, engine.state_dict()["master"], engine.early.last_count))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert runs[1][2] > 0 and runs[0][2] == 0
