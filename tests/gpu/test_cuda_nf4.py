"""CUDA-only: a frozen base kept in NF4 (issue 72; the CPU twins are tests/test_nf4_base.py). LoRA
(peft) on a GPT with ``Config(frozen_format="nf4")`` under a budget that evicts, both modes, bf16:
losses track plain PyTorch training the same model with its linear weights replaced by their NF4
round trip, every step within the budget by the caching allocator's own count (the dequantization
workspace included), and each NF4 fetch moves the packed bytes."""

import pytest
import torch
from torch import nn

import pscompile
from pscompile.memory import nf4
from pscompile.models.gpt import GPT, GPTConfig
from pscompile.testing import ReferenceTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
peft = pytest.importorskip("peft")


def _model(round_trip: bool = False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=128, vocab_size=512, seq_len=64))
    cfg = peft.LoraConfig(r=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(model, cfg).to(torch.bfloat16)
    if round_trip:
        tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear) and not m.weight.requires_grad and id(m.weight) not in tied:
                    m.weight.copy_(nf4.dequantize(nf4.quantize(m.weight), torch.bfloat16))
    return model


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_cuda_nf4_base_tracks_plain_pytorch_within_the_allocator_budget(mode):
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))
    config = pscompile.Config(mode=mode, device="cuda", dtype=torch.bfloat16, frozen_format="nf4")
    budget = int(1.15 * pscompile.min_device_memory(_model(), batch, config))
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(_model(round_trip=True), optimizer=hp, dtype=torch.bfloat16, device="cuda")
    engine = pscompile.compile(_model(), batch, optimizer=hp, config=pscompile.Config(
        mode=mode, device="cuda", dtype=torch.bfloat16, device_memory=budget, frozen_format="nf4"))
    assert engine.layout.quantized_chunks
    runs = [(engine.step(batch), ref.step(batch), engine.stats) for _ in range(5)]
    assert all(abs(ours - plain) <= 2e-2 * abs(plain) for ours, plain, _ in runs), runs
    peaks = [s.allocator_peak_bytes for _, _, s in runs]      # the allocator's count, every step
    assert None not in peaks and max(peaks) <= budget, (peaks, budget)
    assert all(s.num_fetches > 0 for _, _, s in runs)
    if mode == "compiled":
        packed = nf4.packed_bytes(engine.layout.chunk_size)
        assert any(a.nbytes == packed for a in engine.last_plan.actions if a.kind == "fetch")
    engine.close()


@pytest.mark.parametrize("mode", ["compiled", "hooks"])
def test_cuda_a_base_bitsandbytes_loaded_in_4_bits_tracks_plain_pytorch_within_the_allocator_budget(mode, tmp_path):
    """QLoRA as users load it on a GPU (bitsandbytes' CUDA kernels in the reference): a tiny Llama
    loaded with ``BitsAndBytesConfig(load_in_4bit=True)`` and double quantization, peft's LoRA, bf16."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)

    def qlora():
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, quantization_config=q, device_map="cuda",
                                                              dtype=torch.bfloat16)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0, init_lora_weights=False))
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    batch = {"input_ids": ids, "labels": ids}
    config = dict(mode=mode, device="cuda", dtype=torch.bfloat16)
    budget = int(1.15 * pscompile.min_device_memory(qlora(), batch, pscompile.Config(**config)))
    hp = pscompile.AdamW(lr=1e-3)
    ref = ReferenceTrainer(qlora(), optimizer=hp, dtype=torch.bfloat16, device="cuda")
    engine = pscompile.compile(qlora(), batch, optimizer=hp, config=pscompile.Config(**config, device_memory=budget))
    assert len(engine.layout.quantized_chunks) > 0
    runs = [(engine.step(batch), ref.step(batch), engine.stats) for _ in range(5)]
    assert all(abs(ours - plain) <= 2e-2 * abs(plain) for ours, plain, _ in runs), runs
    peaks = [s.allocator_peak_bytes for _, _, s in runs]
    assert None not in peaks and max(peaks) <= budget, (peaks, budget)
    assert all(s.num_fetches > 0 for _, _, s in runs)
    engine.close()
