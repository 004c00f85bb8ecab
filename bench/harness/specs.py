"""Named model sizes: a GPT of the project's own model code, "L{layers} d{width}", with one rule for
its head count (``heads``), so "L2 d128" is the same model in every table."""

from __future__ import annotations

import torch

from pscompile.models.gpt import GPT, GPTConfig

HEAD_DIM = 64      # every bench GPT: d_model // 64 heads (at least one)


def heads(d_model: int) -> int:
    """The head count of a bench GPT of width ``d_model``."""
    return max(1, d_model // HEAD_DIM)


def gpt_config(n_layer: int, d_model: int, vocab: int, seq: int, **kw) -> GPTConfig:
    """``GPTConfig`` of the named size "L{n_layer} d{d_model}" (``kw``: dropout, n_head, ...)."""
    return GPTConfig(n_layer=n_layer, d_model=d_model, vocab_size=vocab, seq_len=seq, **{"n_head": heads(d_model), **kw})


def gpt(n_layer: int, d_model: int, vocab: int, seq: int, *, seed: int = 0, **kw) -> GPT:
    """A fresh GPT of the named size, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return GPT(gpt_config(n_layer, d_model, vocab, seq, **kw))


def gpt_of(s: dict, **kw) -> GPT:
    """``gpt`` from a settings dict with ``n_layer`` (or ``layers``), ``d``, ``vocab`` and ``seq``."""
    return gpt(s.get("n_layer", s.get("layers")), s["d"], s["vocab"], s["seq"], **kw)


def token_batches(vocab: int, batch: int, seq: int, n: int, *, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (tokens, targets) batches of random token ids, the same for every system of a run."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(n)]


def adamw(lr: float = 1e-3, **kw):
    """The optimizer every bench row uses (``pscompile.AdamW``; plain rows: ``torch.optim.AdamW``)."""
    import pscompile
    return pscompile.AdamW(lr=lr, **kw)
