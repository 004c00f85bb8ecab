"""Plain PyTorch mixed-precision training: the yardstick every pscompile mode must match.

Compute-dtype parameters for forward and backward, fp32 master weights updated by
``torch.optim.AdamW``, gradients upcast to fp32; float16 uses ``torch.amp.GradScaler``-style
dynamic loss scaling; optional ``clip_grad_norm_``. Everything lives on one device, so its peak
memory is what training without pscompile needs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from pscompile.runtime.batching import LossFn, as_batch, call_model, extract_loss, micro_batches, to_device
from pscompile.config import AdamW
from pscompile.optim.adamw import LossScaler
from pscompile.optim.groups import resolve_groups


class ReferenceTrainer:
    def __init__(self, model: nn.Module, *, optimizer: AdamW, dtype: torch.dtype,
                 device: str | torch.device = "cpu", loss_fn: LossFn | None = None,
                 initial_loss_scale: float = 2.0**16, growth_interval: int = 2000, copy_model: bool = True,
                 staleness: int = 0, fused: bool = False):
        """``staleness`` > 0: lock-free updating's delayed gradients -- the update applied after
        step ``t`` uses the gradients of step ``t - staleness`` (``flush`` applies the rest).
        ``fused``: ``torch.optim.AdamW(fused=True)`` (a speed baseline; the same math)."""
        self.staleness = staleness
        self._queued: list[list[torch.Tensor | None]] = []
        self.device = torch.device(device)
        self.dtype = dtype
        self.loss_fn = loss_fn
        self.model = copy.deepcopy(model) if copy_model else model
        self.model.to(self.device)
        # (integer parameters, a base bitsandbytes loaded in 4 bits, are frozen codes the model reads)
        self.params = [p for p in self.model.parameters() if p.dtype.is_floating_point]
        if dtype == torch.float32:       # fp32 compute: the parameters are their own master copy
            self.master = self.params
        else:
            self.master = [p.detach().float().clone() for p in self.params]
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.data = m.to(dtype)
            for m in self.master:
                m.requires_grad_(True)
        hp = optimizer
        self.hp = hp
        self.opt = torch.optim.AdamW(self._torch_groups(hp), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                     weight_decay=hp.weight_decay, fused=fused or None)
        self.scaler = LossScaler(initial_loss_scale, growth_interval) if dtype == torch.float16 else None

    def _torch_groups(self, hp: AdamW) -> list[dict]:
        """``hp.param_groups`` as torch.optim.AdamW's parameter groups of the master weights."""
        named = {n: p for n, p in self.model.named_parameters() if p.dtype.is_floating_point}
        master_of = {n: m for n, m in zip(named, self.master)}
        aliases = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            if not p.dtype.is_floating_point:
                continue
            first = next(f for f, q in named.items() if q is p)
            if n != first:
                aliases[n] = first
        groups = resolve_groups(hp, named, aliases)
        return [{"params": [master_of[n] for n in names], **{k: v for k, v in g.items() if k != "params"}}
                for names, g in zip(groups.names, groups.describe())]

    def step(self, batch: Any) -> float:
        """One update; a list of micro-batches accumulates ``(loss / k).backward()`` over them."""
        batch = as_batch(batch)
        micro = micro_batches(batch)
        batches = [to_device(b, self.device) for b in (micro if micro is not None else [batch])]
        scale = self.scaler.scale if self.scaler is not None else 1.0
        losses = []
        for b in batches:
            loss = extract_loss(call_model(self.model, b), b, self.loss_fn)
            (loss * (scale / len(batches))).backward()
            losses.append(float(loss.detach()))
        loss = torch.tensor(sum(losses) / len(losses))
        if self.master is not self.params:
            for p, m in zip(self.params, self.master):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        if self.staleness:
            self._queued.append([None if m.grad is None else m.grad.clone() for m in self.master])
            self.opt.zero_grad(set_to_none=True)
            if len(self._queued) > self.staleness:
                self._apply(self._queued.pop(0))
            return float(loss.detach())
        grads = [m.grad for m in self.master if m.grad is not None]
        if self.scaler is not None:
            found_inf = not all(torch.isfinite(g).all() for g in grads)
            self.scaler.update(found_inf)
            if found_inf:
                self.opt.zero_grad(set_to_none=True)
                return float(loss.detach())
            for g in grads:
                g.mul_(1.0 / scale)
        self._apply([m.grad for m in self.master])
        return float(loss.detach())

    def _apply(self, grads: list[torch.Tensor | None]) -> None:
        """Clip (if asked), AdamW on the masters with ``grads``, cast into the parameters."""
        for m, g in zip(self.master, grads):
            m.grad = g
        if self.hp.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.master if m.grad is not None], self.hp.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)

    def flush(self) -> None:
        """Delayed gradients: apply every queued update now (as a lock-free engine's
        ``state_dict`` and ``close`` do)."""
        while self._queued:
            self._apply(self._queued.pop(0))

    def master_state(self) -> dict[str, torch.Tensor]:
        """fqn -> fp32 master weight (tied parameters under their first name)."""
        names = {}
        for fqn, p in self.model.named_parameters():
            names[id(p)] = fqn
        return {names[id(p)]: m.detach() for p, m in zip(self.params, self.master)}


# ==================================================================== tiny models of each architecture
# The architectures the README claims: pscompile's own GPT and BERT, and tiny configs of Hugging Face
# models built from their config classes (nothing is downloaded; transformers is the `hf` extra).
ARCHITECTURES = ("gpt", "bert", "hf-gpt2", "hf-bert", "opt", "llama", "mistral", "gpt-neox", "t5")
HF_ARCHITECTURES = ARCHITECTURES[2:]
# models tiny_model also builds that are tested through Inductor only (not in the budget sweeps):
# Mixtral's router computes the expert ids and token positions that later regions index with
EXTRA_ARCHITECTURES = ("mixtral",)


def tiny_model(name: str, *, seed: int = 0, batch_size: int = 2, seq_len: int = 32,
               dropout: bool = False) -> tuple[nn.Module, Any]:
    """A 2-layer model of architecture ``name`` (hidden 64, 2 heads, vocabulary 256, no KV cache) and
    one example batch for it (a tuple for pscompile's models, a dict with labels for Hugging
    Face's). No dropout, unless ``dropout``: then each Hugging Face model keeps its configuration's
    default dropout (0.1 for GPT-2, BERT, OPT and T5; Llama, Mistral, GPT-NeoX and Mixtral default
    to none), and pscompile's own models take 0.1."""
    if name not in ARCHITECTURES + EXTRA_ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; use one of {ARCHITECTURES + EXTRA_ARCHITECTURES}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    vocab = 256
    ids = torch.randint(1, vocab, (batch_size, seq_len), generator=g)
    if name in ("gpt", "bert"):
        from pscompile.models.bert import BertMLM, bert_config, mask_tokens
        from pscompile.models.gpt import GPT, gpt_config
        p = {"dropout": 0.1} if dropout else {}
        if name == "gpt":
            return GPT(gpt_config("gpt-tiny", seq_len=seq_len, **p)), (ids, torch.roll(ids, -1, dims=1))
        inputs, labels = mask_tokens(ids, vocab_size=vocab, generator=g)
        return BertMLM(bert_config("bert-tiny", seq_len=seq_len, **p)), (inputs, labels)
    import transformers as tf
    common = dict(vocab_size=vocab, use_cache=False)
    off = (lambda **fields: {}) if dropout else (lambda **fields: fields)     # the dropout fields, or none
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    if name == "hf-gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, bos_token_id=0,
                                                 eos_token_id=0, **off(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                                                 **common))
    elif name == "hf-bert":
        model = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                 intermediate_size=128, max_position_embeddings=64,
                                                 **off(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                                                 vocab_size=vocab))
    elif name == "opt":
        model = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                               ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64,
                                               **off(dropout=0.0, attention_dropout=0.0), **common))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                   intermediate_size=128, max_position_embeddings=64, **common))
    elif name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                       num_key_value_heads=1, intermediate_size=128,
                                                       max_position_embeddings=64, sliding_window=16, **common))
    elif name == "mixtral":       # 4 experts, top-2 routing, transformers' default experts implementation
        model = tf.MixtralForCausalLM(tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                       num_key_value_heads=1, intermediate_size=128,
                                                       num_local_experts=4, num_experts_per_tok=2,
                                                       max_position_embeddings=64, **common))
    elif name == "gpt-neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                                       intermediate_size=128, max_position_embeddings=64, **common))
    else:
        model = tf.T5ForConditionalGeneration(tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128,
                                                          num_heads=2, d_kv=32, **off(dropout_rate=0.0),
                                                          decoder_start_token_id=0, **common))
    return model, batch


class RoutedGather(nn.Module):
    """A model whose compiled regions index with positions computed from another region's values:
    each token adds the hidden state of another token, at ``floor(num / den)``, where ``num`` and
    ``den`` come from a gate early in the forward and the gather comes after ``depth`` layers (under
    a budget their chunks are fetched in between, so the division and the gather are in a later
    region than their operands). For real inputs ``den`` is 1 and the position is in range; for
    zeros ``0 / 0`` is NaN, which as an index is out of range. ``forward(ids, labels)`` returns the
    loss; ``routed_gather()`` builds one and a batch."""

    def __init__(self, vocab: int = 64, d: int = 32, seq: int = 16, depth: int = 4):
        super().__init__()
        self.seq = seq
        self.emb = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, 1)
        self.mid = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        g = torch.sigmoid(self.gate(x)).squeeze(-1)
        den = g.detach() * 0 + 1                     # 1 for real inputs
        num = g.detach() * (self.seq - 1) * den
        h = x
        for m in self.mid:
            h = torch.tanh(m(h))
        pos = torch.floor(num / den).long()
        picked = torch.gather(h, 1, pos.unsqueeze(-1).expand_as(h))
        h = h + picked * g.unsqueeze(-1)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def routed_gather(*, seed: int = 0) -> tuple[RoutedGather, tuple[torch.Tensor, torch.Tensor]]:
    """A ``RoutedGather`` (seeded) and a batch of 2 x 16 tokens."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return RoutedGather(), (ids, torch.roll(ids, -1, dims=1))


class InplaceZoo(nn.Module):
    """A stack of Linear layers with one in-place (or random) op of its own after each: every op a
    captured graph can hold from a model's code, each on an intermediate (some on a view of one),
    between layers whose chunks a tight budget fetches and evicts around it."""

    OPS = ("add_", "mul_", "div_", "copy_", "masked_fill_", "index_put_", "clamp_", "zero_", "fill_",
           "scatter_", "bernoulli_", "uniform_", "normal_", "dropout", "rand_like", "randn_like", "attention_dropout")

    def __init__(self, d: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in self.OPS)
        self.head = nn.Linear(d, 1)

    @staticmethod
    def apply(op: str, h: torch.Tensor) -> torch.Tensor:
        """``op`` on ``h`` (a fresh intermediate), in place where the op is; the value to go on with."""
        if op == "add_":
            return h.add_(0.5)
        if op == "mul_":
            return h.mul_(1.5)
        if op == "div_":
            return h.div_(2.0)
        if op == "copy_":
            out = torch.empty_like(h)
            out.copy_(h * 2)
            return out
        if op == "masked_fill_":
            return h.masked_fill_(h > 0.5, 0.25)
        if op == "index_put_":
            rows = torch.arange(0, h.shape[0], 2, device=h.device)
            return h.index_put_((rows,), h[rows] * 0.5 + 0.1, accumulate=True)
        if op == "clamp_":
            return h.clamp_(-1.0, 1.0)
        if op == "zero_":
            h[..., :2].zero_()                    # in place on a view
            return h
        if op == "fill_":
            h[..., -1:].fill_(0.5)                # in place on a view
            return h
        if op == "scatter_":
            idx = torch.zeros_like(h, dtype=torch.long)[..., :4] + torch.arange(4, device=h.device) * 5
            return h.scatter_(-1, idx, h[..., :4] * -1.0)
        if op == "bernoulli_":
            return h * torch.empty_like(h).bernoulli_(0.8).div_(0.8)
        if op == "uniform_":
            return h + torch.empty_like(h).uniform_(-0.1, 0.1)
        if op == "normal_":
            return h + torch.empty_like(h).normal_(0.0, 0.1)
        if op == "dropout":
            return nn.functional.dropout(h, 0.2, training=True)
        if op == "rand_like":
            return h * (torch.rand_like(h) > 0.1)
        if op == "randn_like":
            return h + 0.05 * torch.randn_like(h)
        if op == "attention_dropout":             # (its mask: empty_like(weights).bernoulli_(p).div_(1 - p))
            q = h.unsqueeze(1)
            return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.2).squeeze(1)
        raise ValueError(op)

    def forward(self, x, y):
        h = x
        for op, layer in zip(self.OPS, self.layers):
            h = torch.tanh(self.apply(op, layer(h)))
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)


def inplace_zoo(*, seed: int = 7) -> tuple[InplaceZoo, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An ``InplaceZoo`` (seeded) and 8 batches of 4 x 8 rows of width 32 with their targets."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    return InplaceZoo(), [(torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, generator=g)) for _ in range(8)]
