"""Two tiny attention layers that declare themselves to QK-Clip (titan_core.HeadAttention): a
grouped-query one (Llama's wq/wk/wv/wo) and a latent-attention-like one (per-head position-free
query and key parts, a query part whose key is one shared by every head, values beside the
keys in one projection: MLA's layout without the latent compression or the rotation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import HeadAttention, QKClipLayout, QKClipRows


class TinyGQA(nn.Module, HeadAttention):
    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8):
        super().__init__()
        self.head_dim, self.heads = head_dim, (heads, kv_heads)
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def attention_heads(self) -> tuple[int, int]:
        return self.heads

    def qk_clip_layout(self) -> QKClipLayout:
        d = self.head_dim
        return QKClipLayout(
            d**-0.5,
            (QKClipRows(self.wq.weight, "query", (("q", d),)),
             QKClipRows(self.wk.weight, "kv", (("k", d),))),
        )  # fmt: skip

    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        return self.wo(self.attend(q, k, v, None).transpose(1, 2).reshape(b, s, -1))


class TinyMLA(nn.Module, HeadAttention):
    def __init__(self, dim: int = 32, heads: int = 4, nope: int = 8, rope: int = 4, v: int = 6):
        super().__init__()
        self.n_heads, self.nope, self.rope, self.v = heads, nope, rope, v
        self.scale = 0.7 * (nope + rope) ** -0.5  # a scale of its own, as YaRN's
        self.wq = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.wkv = nn.Linear(dim, heads * (nope + v), bias=False)
        self.wk_shared = nn.Linear(dim, rope, bias=False)
        self.wo = nn.Linear(heads * v, dim, bias=False)

    def attention_heads(self) -> tuple[int, int]:
        return self.n_heads, self.n_heads

    def qk_clip_layout(self) -> QKClipLayout:
        return QKClipLayout(
            self.scale,
            (QKClipRows(self.wq.weight, "query", (("q", self.nope), ("q_alone", self.rope))),
             QKClipRows(self.wkv.weight, "kv", (("k", self.nope), ("none", self.v)))),
        )  # fmt: skip

    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def qkv(self, x: torch.Tensor):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.nope + self.rope)
        k_nope, v = self.wkv(x).view(b, s, -1, self.nope + self.v).split([self.nope, self.v], -1)
        shared = self.wk_shared(x)[:, :, None].expand(-1, -1, k_nope.shape[2], -1)
        k = torch.cat([k_nope, shared], dim=-1)
        v = F.pad(v, (0, self.nope + self.rope - self.v))
        return (t.transpose(1, 2) for t in (q, k, v))

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.qkv(x)
        return q, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x)
        out = self.attend(q, k, v, None)[..., : self.v]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TinyModel(nn.Module):
    """An embedding, two attention layers (residual) and an output head."""

    def __init__(self, kind: str = "gqa", vocab: int = 64, dim: int = 32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        attention = TinyGQA if kind == "gqa" else TinyMLA
        self.layers = nn.ModuleList([attention(dim) for _ in range(2)])
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(F.rms_norm(h, (h.shape[-1],)))
        return self.output(F.rms_norm(h, (h.shape[-1],)))
