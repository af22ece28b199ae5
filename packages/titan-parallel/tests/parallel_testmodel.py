"""A tiny decoder-only transformer for titan-parallel's tests: SDPA attention, RMSNorm, a
SwiGLU MLP and a `tp_plan()`. Small enough that a step takes milliseconds on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.protocols import TPPlan


@dataclass
class TinyArgs:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 4
    hidden: int = 48
    n_layers: int = 2


class Attention(nn.Module):
    def __init__(self, a: TinyArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, a.dim, bias=False)
        self.wv = nn.Linear(a.dim, a.dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under TP each rank holds a share of the heads.
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, a: TinyArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.hidden, bias=False)
        self.w2 = nn.Linear(a.hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a: TinyArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.feed_forward = SwiGLU(a)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), scale)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, a: TinyArgs | None = None):
        super().__init__()
        self.args = a = a or TinyArgs()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        scale = (self.args.dim // self.args.n_heads) ** -0.5
        for block in self.layers.values():
            h = block(h, scale)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.trunc_normal_(p, std=0.1)
        # Norm weights start at 1 in every real model; nudging them makes a broken
        # sequence-parallel gradient on them visible in the parity tests.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)

    def tp_plan(self) -> TPPlan:
        return TPPlan(
            root={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
            block={
                "attention_norm": "sequence_parallel",
                "attention": "block_input",
                "attention.wq": "colwise",
                "attention.wk": "colwise",
                "attention.wv": "colwise",
                "attention.wo": "rowwise",
                "ffn_norm": "sequence_parallel",
                "feed_forward": "block_input",
                "feed_forward.w1": "colwise",
                "feed_forward.w2": "rowwise",
                "feed_forward.w3": "colwise",
            },
            divisible_by_tp={"n_heads": self.args.n_heads, "hidden": self.args.hidden},
        )

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
