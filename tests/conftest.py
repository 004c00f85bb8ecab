"""Shared builders for the tests: tiny models, deterministic batches, parity runs."""

from __future__ import annotations

import pytest
import torch

import pscompile
from pscompile.models.bert import BertMLM, bert_config, mask_tokens
from pscompile.models.gpt import GPT, gpt_config
from pscompile.testing import ReferenceTrainer


def gpt_batches(n: int, *, batch: int = 4, seq: int = 64, vocab: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]


def bert_batches(n: int, *, batch: int = 4, seq: int = 64, vocab: int = 256, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (batch, seq), generator=g)
        masked, labels = mask_tokens(ids, vocab, generator=g)
        out.append({"input_ids": masked, "labels": labels})
    return out


def make_model(kind: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(gpt_config("gpt-tiny", **overrides))
    if kind == "bert":
        return BertMLM(bert_config("bert-tiny", **overrides))
    raise AssertionError(kind)


def make_batches(kind: str, n: int, *, distinct: int = 2, **kw):
    """``n`` batches cycling through ``distinct`` different ones (so a tiny model can learn them)."""
    pool = gpt_batches(distinct, **kw) if kind == "gpt" else bert_batches(distinct, **kw)
    return [pool[i % distinct] for i in range(n)]


def run_parity(kind: str, dtype: torch.dtype, *, steps: int, device_memory=None, chunk_size=2048,
               hp: pscompile.AdamW | None = None, overrides=None):
    """Train the same model with plain PyTorch and with hooks mode, step by step, same seeds.

    Returns (reference losses, engine losses, per-step stats, engine, reference)."""
    overrides = overrides or {}
    hp = hp or pscompile.AdamW(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batches = make_batches(kind, steps)
    ref = ReferenceTrainer(make_model(kind, **overrides), optimizer=hp, dtype=dtype)
    engine = pscompile.compile(
        make_model(kind, **overrides), batches[0], optimizer=hp,
        config=pscompile.Config(mode="hooks", device="cpu", dtype=dtype, device_memory=device_memory,
                                chunk_size=chunk_size))
    ref_losses, eng_losses, stats = [], [], []
    for i, b in enumerate(batches):
        torch.manual_seed(100 + i)
        ref_losses.append(ref.step(b))
        torch.manual_seed(100 + i)
        eng_losses.append(engine.step(b))
        stats.append(engine.stats)
    return ref_losses, eng_losses, stats, engine, ref


def max_weight_diff(engine, ref) -> float:
    ours = engine.state_dict()["master"]
    theirs = ref.master_state()
    assert set(ours) == set(theirs)
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


@pytest.fixture
def tight_budget():
    """A device budget that forces evictions every step: the model's minimum plus two chunks."""
    def compute(kind: str, dtype: torch.dtype, chunk_size: int = 2048, **overrides) -> int:
        engine = pscompile.compile(
            make_model(kind, **overrides), make_batches(kind, 1)[0],
            config=pscompile.Config(mode="hooks", device="cpu", dtype=dtype, chunk_size=chunk_size))
        elsize = torch.empty((), dtype=dtype).element_size()
        return engine.min_device_memory + 2 * chunk_size * elsize
    return compute
