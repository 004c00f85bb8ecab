"""CUDA-only: compiled mode on the GPU -- copies on streams, the allocator's peak as the judge.

- parity of compiled mode (eager and Inductor regions) with plain PyTorch under a budget that
  evicts every step, float32 and bfloat16, with ``torch.cuda.max_memory_allocated`` (reset each
  step, ``StepStats.allocator_peak_bytes``) at or under the budget on every step;
- the copy engine is the CUDA one (a stream per direction), and a step whose copies and compute
  are both large takes less than the two back to back (the copies overlap compute).
"""

import time

import pytest
import torch

import pscompile
from pscompile.memory.cuda_copies import CudaCopies
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model(n_layer=2, d=128, vocab=512, seq=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=max(1, d // 64), d_model=d, vocab_size=vocab, seq_len=seq))


def _batches(n, vocab=512, seq=64, batch=4):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def _config(backend, dtype, budget=None, **kw):
    return pscompile.Config(mode="compiled", backend=backend, device="cuda", dtype=dtype, chunk_size=4096,
                            device_memory=budget, **kw)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_mode_tracks_plain_pytorch_with_the_allocator_under_the_budget(backend, dtype):
    batches = _batches(5)
    hp = pscompile.AdamW(lr=1e-3)
    minimum = pscompile.min_device_memory(_model(), batches[0], _config(backend, dtype))
    elsize = torch.empty((), dtype=dtype).element_size()
    budget = minimum + 2 * 4096 * elsize + (2 << 20)      # evicting (and room for the allocator's rounding)
    ref = ReferenceTrainer(_model(), optimizer=hp, dtype=dtype, device="cuda")
    engine = pscompile.compile(_model(), batches[0], optimizer=hp, config=_config(backend, dtype, budget))
    assert isinstance(engine.copies, CudaCopies)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step, b in enumerate(batches):
        ours, plain = engine.step(b), ref.step(b)
        st = engine.stats
        assert abs(ours - plain) <= tol * abs(plain), (step, ours, plain)
        assert st.peak_device_bytes <= budget, (step, st.peak_device_bytes, budget)
        assert st.allocator_peak_bytes is not None and st.allocator_peak_bytes <= budget, \
            (step, st.allocator_peak_bytes, budget)
        assert st.num_evictions > 0
    engine.close()


def test_strict_copies_is_refused_on_cuda():
    with pytest.raises(ValueError, match="strict_copies is the CPU race checker"):
        pscompile.Config(device="cuda", strict_copies=True)


def test_copies_overlap_compute_when_both_are_large():
    """A GPT whose every step fetches most of its chunks: the step takes less than its compute
    alone (no budget) plus its copies alone (bytes moved / the measured pinned-copy rate)."""
    batches = _batches(6, vocab=4096, seq=256, batch=8)
    make = lambda: _model(n_layer=8, d=1024, vocab=4096, seq=256)      # noqa: E731
    dtype = torch.bfloat16
    free = pscompile.compile(make(), batches[0], config=_config("eager", dtype))
    times = []
    for b in batches:
        free.step(b)
        times.append(free.stats.time_s)
    compute = sorted(times[2:])[len(times[2:]) // 2]
    free.close()
    minimum = pscompile.min_device_memory(make(), batches[0], _config("eager", dtype))
    engine = pscompile.compile(make(), batches[0], config=_config("eager", dtype, int(minimum * 1.15)))
    times, moved = [], []
    for b in batches:
        engine.step(b)
        times.append(engine.stats.time_s)
        moved.append(engine.stats.bytes_moved)
    step = sorted(times[2:])[len(times[2:]) // 2]
    engine.close()
    n = 64 << 20
    src, dst = torch.ones(n // 4, pin_memory=True), torch.empty(n // 4, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t)
    copies = moved[-1] / rate
    assert moved[-1] > 0
    assert step < compute + copies, (step, compute, copies)


def test_dropout_and_inplace_ops_give_the_same_result_in_every_process_on_cuda():
    """bench/determinism.py's children on CUDA (tests/test_random_ops.py on the CPU): a GPT with
    dropout and ``pscompile.testing.InplaceZoo`` under a budget that evicts, in two fresh processes
    each: bit-identical losses and weights, and the eager backend's losses within 1e-5 relative."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "bench" / "determinism.py"
    specs = [{"model": m, "backends": ["inductor", "eager"], "budget": 2, "micro": [1, 1, 1, 2], "device": "cuda",
              **({"chunk_size": 2048} if m == "zoo" else {})} for m in ("gpt", "zoo")]
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script), "--_child", json.dumps(specs)], capture_output=True,
                           text=True, env={**os.environ, "CI": "1"}, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    for i in range(len(specs)):
        a, b = runs[0][i]["inductor"], runs[1][i]["inductor"]
        assert (a["loss"], a["weights"]) == (b["loss"], b["weights"]), specs[i]["model"]
        eager = runs[0][i]["eager"]["loss"]
        for x, y in zip(a["loss"], eager):
            assert abs(float.fromhex(x) - float.fromhex(y)) <= 1e-5 * abs(float.fromhex(y)), (specs[i]["model"], a, eager)
        assert a["share"][-1] == 1.0 and min(a["evictions"]) > 0, a
