"""Hugging Face transformers models (built from tiny configs, no downloads) in both modes.

Each model is called as ``model(**batch)`` with ``{"input_ids", "attention_mask", "labels"}`` and
its output's ``.loss`` is trained; losses must match plain PyTorch step by step under a device
budget that forces evictions.
"""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.testing import ReferenceTrainer

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 256, 2, 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HP = pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def hf_model(kind: str, seed: int = 0):
    """A tiny model from its config class: 2 layers, hidden 64, 2 heads, no dropout, no KV cache."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, use_cache=False,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config)
    if kind == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
            vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager")
        return transformers.BertForMaskedLM(config)
    raise AssertionError(kind)


def hf_batches(kind: str, n: int, *, distinct: int = 2, seed: int = 1):
    """``n`` dict batches cycling through ``distinct`` ones; the second row is right-padded."""
    g = torch.Generator().manual_seed(seed)
    pool = []
    for _ in range(distinct):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 5:] = 0
        if kind == "gpt2":
            labels = ids.masked_fill(mask == 0, -100)
        else:                       # masked LM: predict ~15% of the tokens (and the first one)
            chosen = torch.rand(BATCH, SEQ, generator=g) < 0.15
            chosen[:, 0] = True
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            ids = ids.masked_fill(chosen, 0)
        pool.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return [pool[i % distinct] for i in range(n)]


def hf_config(mode: str, dtype: torch.dtype, device_memory=None) -> pscompile.Config:
    extra = {"backend": "eager"} if mode == "compiled" else {}
    return pscompile.Config(mode=mode, device="cpu", dtype=dtype, device_memory=device_memory, **extra)


def tight_budget(kind: str, mode: str, dtype: torch.dtype) -> int:
    """The unlimited engine's minimum (after its measuring step) plus a few chunks."""
    b = hf_batches(kind, 1)[0]
    engine = pscompile.compile(hf_model(kind), b, config=hf_config(mode, dtype))
    engine.step(b)
    elsize = torch.empty((), dtype=dtype).element_size()
    return engine.min_device_memory + 2 * engine.layout.chunk_size * elsize


CASES = [(k, m, d) for d in (torch.float32, torch.bfloat16) for k in ("gpt2", "bert") for m in ("hooks", "compiled")]


@pytest.mark.parametrize("kind,mode,dtype", CASES,
                         ids=[f"{k}-{m}-{'fp32' if d == torch.float32 else 'bf16'}" for k, m, d in CASES])
def test_hf_parity_under_a_tight_budget(kind, mode, dtype):
    budget = tight_budget(kind, mode, dtype)
    batches = hf_batches(kind, 4)
    ref = ReferenceTrainer(hf_model(kind), optimizer=HP, dtype=dtype)
    engine = pscompile.compile(hf_model(kind), batches[0], optimizer=HP,
                               config=hf_config(mode, dtype, budget))
    over = []
    for i, b in enumerate(batches):
        torch.manual_seed(i)
        a = ref.step(b)
        torch.manual_seed(i)
        c = engine.step(b)
        assert abs(a - c) <= TOL[dtype] * abs(a), f"step {i}: plain {a} vs pscompile {c}"
        assert engine.stats.num_evictions > 0
        if engine.stats.peak_device_bytes > budget:
            over.append((i, engine.stats.peak_device_bytes - budget))
    ours = engine.full_state_dict()
    theirs = ref.model.state_dict()
    initial = ReferenceTrainer(hf_model(kind), optimizer=HP, dtype=dtype).master_state()
    for k, v in ref.master_state().items():
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        assert (ours[k] - v.float()).abs().max().item() <= tol, k
        # each tensor's error in units of its own movement (catches a chunk never updated in bf16:
        # a trained tensor moves about lr = 1e-3 per step). BERT's attention key bias has a zero
        # gradient in exact arithmetic (softmax ignores a constant per query); its roundoff-only
        # gradient moves it by about lr * g / eps, 1.6e-7 over these steps on one thread, and two
        # summation orders give different noise, so the floor is 1e-4 (an absolute 1e-6)
        moved = (v - initial[k]).abs().mean().item()
        assert (ours[k] - v.float()).abs().mean().item() <= 1e-2 * max(moved, 1e-4), k
    assert set(theirs) == set(ours)
    assert not over, f"(step, bytes over budget): {over}"


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_from_pretrained_weights_kept_exactly(kind, mode, tmp_path):
    hf_model(kind, seed=3).save_pretrained(tmp_path)
    cls = type(hf_model(kind))
    model = cls.from_pretrained(tmp_path)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = hf_batches(kind, 1)[0]
    engine = pscompile.compile(model, batch, optimizer=HP, config=hf_config(mode, torch.float32))
    full = engine.full_state_dict()
    assert set(full) == set(original)          # every key, tied aliases included
    for k, v in original.items():
        assert torch.equal(full[k], v.float()), k
    fresh = cls(model.config)
    fresh.load_state_dict(full, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, original[k]), k
    engine.step(batch)                         # trains after loading from a folder
    fresh.load_state_dict(engine.full_state_dict(), strict=True)


@pytest.mark.parametrize("mode", ["hooks", "compiled"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_gradient_accumulation_and_evaluate(kind, mode):
    """A validation-style loop: four micro-batches per update, then evaluate(); both match plain
    PyTorch ((loss / 4).backward() per micro-batch; the model's own loss under no_grad)."""
    budget = tight_budget(kind, mode, torch.float32)
    micro = hf_batches(kind, 4, distinct=4)
    ref = ReferenceTrainer(hf_model(kind), optimizer=HP, dtype=torch.float32)
    engine = pscompile.compile(hf_model(kind), micro[0], optimizer=HP,
                               config=hf_config(mode, torch.float32, budget))
    for step in range(2):
        a, c = ref.step(micro), engine.step(micro)
        assert abs(a - c) <= 1e-5 * abs(a), f"step {step}: plain {a} vs pscompile {c}"
        assert engine.stats.peak_device_bytes <= budget and engine.stats.num_evictions > 0
    with torch.no_grad():
        expected = float(ref.model(**micro[1]).loss)
    for _ in range(2):
        assert engine.evaluate(micro[1]) == pytest.approx(expected, rel=1e-5)
        assert engine.eval_peak_device_bytes <= budget
    ours = engine.full_state_dict()
    for k, v in ref.master_state().items():
        assert (ours[k] - v.float()).abs().max().item() <= 1e-4, k
