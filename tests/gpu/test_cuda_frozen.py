"""CUDA-only: frozen weights (issue 61; the CPU twins are tests/test_frozen*.py). LoRA (peft) on a
GPT under a budget that evicts, both modes, bf16: losses track plain PyTorch + peft on the GPU,
every step within the budget by the caching allocator's own count, frozen weights bit for bit, and
the frozen chunks hold no optimizer state on either tier."""

import pytest
import torch

import pscompile
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
peft = pytest.importorskip("peft")


def _model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=512, seq_len=64))
    cfg = peft.LoraConfig(r=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, cfg).to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_cuda_lora_tracks_plain_pytorch_within_the_allocator_budget(mode):
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))
    config = pscompile.Config(mode=mode, device="cuda", dtype=torch.bfloat16)
    budget = int(1.15 * pscompile.min_device_memory(_model(), batch, config))
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(_model(), optimizer=hp, dtype=torch.bfloat16, device="cuda")
    model = _model()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = pscompile.compile(model, batch, optimizer=hp, config=pscompile.Config(
        mode=mode, device="cuda", dtype=torch.bfloat16, device_memory=budget))
    for step in range(5):
        ours, plain = engine.step(batch), ref.step(batch)
        s = engine.stats
        assert abs(ours - plain) <= 2e-2 * abs(plain), (step, ours, plain)
        assert s.allocator_peak_bytes is not None and s.allocator_peak_bytes <= budget, (step, s.allocator_peak_bytes)
        assert s.num_fetches > 0
    assert all(engine.store.state_numel(c) == 0 for c in engine.layout.frozen_chunks)
    weights = engine.full_state_dict()
    for n, w in frozen.items():
        assert torch.equal(weights[n].to(w.dtype).cpu(), w.cpu()), n
    engine.close()
