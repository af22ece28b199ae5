"""A small GPT-2-style language model written the way a user would, with nothing of ours but
the attributes titan-parallel reads: learned position embeddings, LayerNorms and linears with
biases, a GELU MLP, and an output projection tied to the token embedding.

It adds a full-sequence position table to the token embeddings, so under tensor parallel it
runs without sequence parallel (whose embedding output is a sequence shard)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.protocols import TPPlan

VOCAB, DIM, HEADS, LAYERS, MAX_SEQ = 64, 32, 4, 2, 16


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        # No key bias: it adds the same score to every key of a query, which softmax ignores,
        # so its gradient is zero and Adam would move it by rounding noise alone.
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, DIM // HEADS).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.c_proj = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    pre_blocks = ("wte", "wpe")
    post_blocks = ("ln_f", "lm_head")

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(MAX_SEQ, DIM)
        self.layers = nn.ModuleDict({str(i): GPT2Block() for i in range(LAYERS)})
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.ln_f(h))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for name, p in self.named_parameters():  # the tied matrix once, under its first name
            if "ln" in name:
                nn.init.normal_(p, mean=1.0 if name.endswith("weight") else 0.0, std=0.1)
            elif name.endswith("bias"):
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.normal_(p, std=0.1)

    def tp_plan(self) -> TPPlan:
        return TPPlan(
            root={"wte": "embedding", "lm_head": "output"},
            block={
                "attn.q_proj": "colwise",
                "attn.k_proj": "colwise",
                "attn.v_proj": "colwise",
                "attn.c_proj": "rowwise",
                "mlp.c_fc": "colwise",
                "mlp.c_proj": "rowwise",
            },
            divisible_by_tp={"heads": HEADS},
        )
