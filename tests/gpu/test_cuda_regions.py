"""CUDA-only: compiled regions measured on the inputs they really receive (compiled/probe.py).

On a GPU a region run on made-up indices is an out-of-bounds access or a device-side assert that
ends the CUDA context; here a model gathers at positions computed from values an earlier region
made, under an evicting budget, through Inductor on the GPU, and tracks plain PyTorch there.
"""

import pytest
import torch
from torch import nn

import pscompile
from pscompile.testing import ReferenceTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class RoutedGather(nn.Module):
    """``floor(num / den)`` picks another token's hidden state; ``den`` is 1 for real inputs, and
    zeros would make the position NaN (out of range)."""

    def __init__(self, vocab: int = 64, d: int = 32, seq: int = 16, depth: int = 4):
        super().__init__()
        self.seq = seq
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, 1)
        self.mid = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids)
        g = torch.sigmoid(self.gate(x)).squeeze(-1)
        den = g.detach() * 0 + 1
        num = g.detach() * (self.seq - 1) * den
        h = x
        for m in self.mid:
            h = torch.tanh(m(h))
        pos = torch.floor(num / den).long()
        h = h + torch.gather(h, 1, pos.unsqueeze(-1).expand_as(h)) * g.unsqueeze(-1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _model():
    torch.manual_seed(0)
    return RoutedGather()


def test_cuda_regions_measured_on_real_inputs_track_plain_pytorch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    batch = (ids, torch.roll(ids, -1, dims=1))
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
