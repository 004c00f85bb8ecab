"""CUDA-only: the pieces of ``bench/gpu.py --peers`` that need a GPU: pageable host pools
(``Config.pinned_host=False``) train bit-identically to pinned ones under an evicting budget, and
FSDP2 + CPU offload on one NCCL rank tracks plain PyTorch under the device cap."""

import sys
from pathlib import Path

import pytest
import torch

import pscompile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BENCH = Path(__file__).resolve().parents[2] / "bench"


def _model():
    from pscompile.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=4096, seq_len=64))


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 4096, (2, 64), generator=g), torch.randint(0, 4096, (2, 64), generator=g))
            for _ in range(n)]


def test_cuda_pageable_host_pools_train_like_pinned_ones():
    batches = _batches()
    base = dict(mode="compiled", backend="eager", device="cuda", dtype=torch.bfloat16, chunk_size=1 << 14)
    budget = pscompile.min_device_memory(_model(), batches[0], pscompile.Config(**base)) + 2 * (1 << 15)
    runs = []
    for pinned in (True, False):
        engine = pscompile.compile(_model(), batches[0],
                                   config=pscompile.Config(**base, device_memory=budget, pinned_host=pinned))
        losses = [engine.step(b) for b in batches]
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
        homes = [c for c, t in enumerate(engine.store.host_param) if t.numel()]
        assert homes and all(engine.store.host_param[c].is_pinned() == pinned for c in homes)
        runs.append((losses, engine.state_dict()["master"]))
        engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_cuda_fsdp2_with_cpu_offload_tracks_plain_pytorch_under_the_cap():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from cudabench import peers, rows
    s = dict(rows.GPU, speed=(2, 256), seq=64, batch=2, vocab=4096)
    data = rows.batches(s, 4)
    ref = rows.run_plain(s["speed"], data, s, "cuda", torch.bfloat16, compiled=False)
    row = peers.run_fsdp2(s["speed"], data, s, "cuda", torch.bfloat16, 256 << 20, pscompile.AdamW(lr=1e-3))
    diffs = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(row["steps"], ref["steps"])]
    assert max(diffs) < 5e-2, diffs
    assert 0 < row["steps"][-1]["allocator_peak"] <= 256 << 20
