"""BERT-like masked language model (post-LN encoder as in the original BERT), plus presets.

Rule for every module here: a parameter is only ever used inside the forward of
the module that owns it (pscompile's memory manager works from module hooks).
The MLM decoder shares its weight with the word embedding, so both own it.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class BertConfig:
    n_layer: int  # number of encoder layers
    n_head: int  # attention heads per layer; must divide d_model
    d_model: int  # hidden size
    vocab_size: int  # number of token ids
    seq_len: int  # maximum sequence length (rows of the position embedding)
    type_vocab_size: int = 2  # number of token type (segment) ids
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    layer_norm_eps: float = 1e-12  # LayerNorm epsilon

    def num_params(self) -> int:
        """Parameter count computed analytically (the tied word embedding counted once)."""
        d, V = self.d_model, self.vocab_size
        embed = (V + self.seq_len + self.type_vocab_size) * d + 2 * d  # word/pos/type + LayerNorm
        layer = (
            3 * d * d + 3 * d  # attn.qkv
            + d * d + d  # attn.out
            + 2 * d  # ln_attn
            + 4 * d * d + 4 * d  # ffn.fc1
            + 4 * d * d + d  # ffn.fc2
            + 2 * d  # ln_ffn
        )
        head = d * d + d + 2 * d + V  # dense + LayerNorm + decoder bias (weight tied)
        return embed + self.n_layer * layer + head


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embeddings = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids, token_type_ids):
        T = input_ids.size(1)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type_ids)
        )  # (B, T, C)
        return self.drop(self.ln(x))  # (B, T, C)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "n_head must divide d_model"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x, attn_mask=None):
        B, T, C = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out(y)  # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.fc2(self.gelu(self.fc1(x)))  # (B, T, C)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln_attn = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ln_ffn = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask=None):
        x = self.ln_attn(x + self.drop(self.attn(x, attn_mask)))  # (B, T, C), post-LN
        x = self.ln_ffn(x + self.drop(self.ffn(x)))  # (B, T, C), post-LN
        return x


class MLMHead(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)  # weight tied to word embedding

    def forward(self, x):
        x = self.ln(self.gelu(self.dense(x)))  # (B, T, C)
        return self.decoder(x)  # (B, T, V)


class BertMLM(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.n_layer)])
        self.head = MLMHead(cfg)
        self.head.decoder.weight = self.embeddings.word_embeddings.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, labels=None, attention_mask=None, token_type_ids=None):
        B, T = input_ids.shape  # (B, T)
        assert T <= self.config.seq_len, f"sequence length {T} > seq_len {self.config.seq_len}"
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)  # (B, T)
        attn_mask = None
        if attention_mask is not None:
            attn_mask = attention_mask.bool().view(B, 1, 1, T)  # (B, 1, 1, T), True = attend
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, attn_mask)  # (B, T, C)
        logits = self.head(x)  # (B, T, V)
        if labels is None:
            return logits
        return F.cross_entropy(
            logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100
        )  # scalar, float32


def mask_tokens(input_ids, vocab_size, mask_prob=0.15, mask_token_id=None, generator=None):
    """BERT-style MLM corruption: returns (masked_input_ids, labels).

    Each position is selected with probability `mask_prob` (at least one per batch);
    selected positions become `mask_token_id` (default: vocab_size - 1) 80% of the
    time, a random token 10%, and stay unchanged 10%. labels hold the original id at
    selected positions and -100 elsewhere. `generator` must live on input_ids' device.
    """
    if mask_token_id is None:
        mask_token_id = vocab_size - 1
    dev = input_ids.device
    selected = torch.rand(input_ids.shape, generator=generator, device=dev) < mask_prob  # (B, T)
    if not selected.any():
        i = torch.randint(input_ids.numel(), (1,), generator=generator, device=dev)
        selected.view(-1)[i] = True
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))  # (B, T)
    r = torch.rand(input_ids.shape, generator=generator, device=dev)  # (B, T)
    rand_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=dev)  # (B, T)
    masked = input_ids.clone()  # (B, T)
    masked[selected & (r < 0.8)] = mask_token_id
    rand_pos = selected & (r >= 0.8) & (r < 0.9)
    masked[rand_pos] = rand_ids[rand_pos].to(masked.dtype)
    return masked, labels


# Small presets for tests and CPU runs, and the original BERT base/large shapes.
BERT_PRESETS: dict[str, BertConfig] = {
    "bert-tiny": BertConfig(n_layer=2, n_head=2, d_model=64, vocab_size=256, seq_len=64),
    "bert-small-test": BertConfig(n_layer=2, n_head=4, d_model=128, vocab_size=256, seq_len=128),
    "bert-base": BertConfig(n_layer=12, n_head=12, d_model=768, vocab_size=30522, seq_len=512),
    "bert-large": BertConfig(n_layer=24, n_head=16, d_model=1024, vocab_size=30522, seq_len=512),
}


def bert_config(name: str, **overrides) -> BertConfig:
    """A copy of preset `name` with `overrides` (BertConfig fields) applied."""
    if name not in BERT_PRESETS:
        raise ValueError(f"unknown BERT preset {name!r}; valid names: {', '.join(BERT_PRESETS)}")
    return replace(BERT_PRESETS[name], **overrides)
