"""CUDA-only: the ecosystem surface on the GPU -- ``compile(model)`` built at its first step with a
torch LR scheduler, and ``materialize`` on the GPU and on the host (the buffers follow the weights
and come back)."""

import pytest
import torch

import pscompile
from pscompile.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=512, seq_len=64))


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))
            for _ in range(n)]


def _config(budget=None):
    return pscompile.Config(mode="compiled", backend="eager", device="cuda", dtype=torch.float32, chunk_size=4096,
                            device_memory=budget)


def test_lazy_compile_with_a_scheduler_matches_the_batch_first_form_on_cuda():
    batches = _batches(4)
    budget = pscompile.min_device_memory(_model(), batches[0], _config()) + 2 * 4096 * 4 + (2 << 20)
    eager = pscompile.compile(_model(), batches[0], config=_config(budget))
    lazy = pscompile.compile(_model(), config=_config(budget))
    s1 = torch.optim.lr_scheduler.OneCycleLR(eager.optimizer, max_lr=3e-3, total_steps=4)
    s2 = torch.optim.lr_scheduler.OneCycleLR(lazy.optimizer, max_lr=3e-3, total_steps=4)
    for b in batches:
        assert eager.step(b) == lazy.step(b)
        assert lazy.stats.allocator_peak_bytes <= budget
        s1.step()
        s2.step()
    eager.close()
    lazy.close()


@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_materialize_gives_the_model_its_current_weights_on_either_device(where):
    batches = _batches(2)
    model = _model()
    engine = pscompile.compile(model, batches[0], config=_config())
    engine.step(batches[0])
    plain = _model().to(where)
    plain.load_state_dict({k: v.to(where) for k, v in engine.full_state_dict().items()})
    idx = batches[1][0].to(where)
    with engine.materialize(device=where), torch.no_grad():
        got = model(idx)
        assert all(b.device.type == where for b in model.buffers())
    with torch.no_grad():
        want = plain(idx)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(b.device.type == "cuda" for b in model.buffers()), "the buffers did not come back"
    engine.step(batches[1])
    engine.close()


def test_a_profiled_cuda_step_shows_the_memory_nodes_and_the_copies_on_the_gpu(tmp_path):
    """``engine.profile`` on CUDA: the memory nodes are ranges on the host's lane (NVTX too) and the
    copies they issue are memcpy events on the GPU's copy streams."""
    import json
    batches = _batches(2)
    budget = pscompile.min_device_memory(_model(), batches[0], _config()) + 2 * 4096 * 4 + (2 << 20)
    engine = pscompile.compile(_model(), batches[0], config=_config(budget))
    engine.step(batches[0])
    engine.profile(tmp_path / "trace.json", batches[1], steps=1)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    assert any(n.startswith("fetch chunk") for n in names) and any(n.startswith("region ") for n in names)
    assert any(e.get("cat") == "gpu_memcpy" for e in events), "no copy on the GPU's lanes"
