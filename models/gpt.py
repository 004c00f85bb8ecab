"""GPT-2-like causal language model (nanoGPT style), plus named size presets.

Rule for every module here: a parameter is only ever used inside the forward of
the module that owns it (pscompile's memory manager works from module hooks).
The LM head shares its weight with the token embedding, so both own it.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    n_layer: int  # number of transformer blocks
    n_head: int  # attention heads per block; must divide d_model
    d_model: int  # hidden size (embedding width)
    vocab_size: int  # number of token ids
    seq_len: int  # maximum sequence length (rows of the position embedding)
    dropout: float = 0.0  # dropout on embeddings, attention and residual branches
    bias: bool = True  # biases in Linear and LayerNorm layers

    def num_params(self) -> int:
        """Parameter count computed analytically (the tied embedding counted once)."""
        d, b = self.d_model, int(self.bias)
        ln = d * (1 + b)  # LayerNorm weight (+ bias)
        block = (
            ln  # ln_1
            + 3 * d * d + 3 * d * b  # attn.c_attn
            + d * d + d * b  # attn.c_proj
            + ln  # ln_2
            + 4 * d * d + 4 * d * b  # mlp.c_fc
            + 4 * d * d + d * b  # mlp.c_proj
        )
        embed = self.vocab_size * d + self.seq_len * d  # wte (= lm_head) + wpe
        return embed + self.n_layer * block + ln  # + ln_f

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter in ``GPT(self).named_parameters()`` order (the tied
        LM head once), without building the model: for planning chunk layouts of models too large
        to build even on the meta device quickly. tests/test_planner.py checks it against GPT."""
        d, v = self.d_model, self.vocab_size
        out = [("wte.weight", (v, d)), ("wpe.weight", (self.seq_len, d))]

        def linear(name, n_in, n_out):
            out.append((f"{name}.weight", (n_out, n_in)))
            if self.bias:
                out.append((f"{name}.bias", (n_out,)))

        def norm(name):
            out.append((f"{name}.weight", (d,)))
            if self.bias:
                out.append((f"{name}.bias", (d,)))
        for i in range(self.n_layer):
            norm(f"h.{i}.ln_1")
            linear(f"h.{i}.attn.c_attn", d, 3 * d)
            linear(f"h.{i}.attn.c_proj", d, d)
            norm(f"h.{i}.ln_2")
            linear(f"h.{i}.mlp.c_fc", d, 4 * d)
            linear(f"h.{i}.mlp.c_proj", 4 * d, d)
        norm("ln_f")
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "n_head must divide d_model"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scaled residual init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        B, T = idx.shape  # (B, T)
        assert T <= self.config.seq_len, f"sequence length {T} > seq_len {self.config.seq_len}"
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
        )  # scalar, float32


# Small presets for tests and CPU runs, GPT-2 small, and GPT shapes from the
# PatrickStar paper (Table 2: seq 1024, 16 heads, GPT-2 vocab). The "ps-*"
# hidden/layer pairs are those of the PatrickStar repo's model configs, whose
# layer counts are chosen so the parameter count matches the nominal size.
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64),
    "gpt-small-test": GPTConfig(n_layer=2, n_head=4, d_model=128, vocab_size=256, seq_len=128),
    "gpt-mini": GPTConfig(n_layer=4, n_head=4, d_model=256, vocab_size=256, seq_len=128),
    "gpt2": GPTConfig(n_layer=12, n_head=12, d_model=768, vocab_size=50257, seq_len=1024),
    "ps-1b": GPTConfig(n_layer=20, n_head=16, d_model=2048, vocab_size=50257, seq_len=1024),
    "ps-2b": GPTConfig(n_layer=40, n_head=16, d_model=2048, vocab_size=50257, seq_len=1024),
    "ps-4b": GPTConfig(n_layer=64, n_head=16, d_model=2304, vocab_size=50257, seq_len=1024),
    "ps-6b": GPTConfig(n_layer=53, n_head=16, d_model=3072, vocab_size=50257, seq_len=1024),
    "ps-8b": GPTConfig(n_layer=72, n_head=16, d_model=3072, vocab_size=50257, seq_len=1024),
    "ps-10b": GPTConfig(n_layer=50, n_head=16, d_model=4096, vocab_size=50257, seq_len=1024),
    "ps-12b": GPTConfig(n_layer=60, n_head=16, d_model=4096, vocab_size=50257, seq_len=1024),
    "ps-15b": GPTConfig(n_layer=78, n_head=16, d_model=4096, vocab_size=50257, seq_len=1024),
    "ps-18b": GPTConfig(n_layer=90, n_head=16, d_model=4096, vocab_size=50257, seq_len=1024),
    "ps-20b": GPTConfig(n_layer=25, n_head=16, d_model=8192, vocab_size=50257, seq_len=1024),
    "ps-30b": GPTConfig(n_layer=37, n_head=16, d_model=8192, vocab_size=50257, seq_len=1024),
    "ps-40b": GPTConfig(n_layer=50, n_head=16, d_model=8192, vocab_size=50257, seq_len=1024),
    "ps-50b": GPTConfig(n_layer=62, n_head=16, d_model=8192, vocab_size=50257, seq_len=1024),
    "ps-60b": GPTConfig(n_layer=75, n_head=16, d_model=8192, vocab_size=50257, seq_len=1024),
    "ps-68b": GPTConfig(n_layer=66, n_head=16, d_model=9216, vocab_size=50257, seq_len=1024),
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A copy of preset `name` with `overrides` (GPTConfig fields) applied."""
    if name not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; valid names: {', '.join(GPT_PRESETS)}")
    return replace(GPT_PRESETS[name], **overrides)
