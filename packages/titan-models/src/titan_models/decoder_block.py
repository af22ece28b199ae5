"""The block every layer of the shared decoder is (`titan_models.decoder`), and the base of a
multi-token-prediction layer (`titan_models.mtp`)."""

from __future__ import annotations

import torch
from torch import nn


class DecoderBlock(nn.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> feed-forward -> residual."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, *tables: torch.Tensor, **attention_inputs) -> torch.Tensor:
        """`tables`: the model's position tables at x's positions; `attention_inputs`:
        `kv_cache` and `start` (generation) or `mask` (packed documents), for the attention."""
        h = x + self.attention(self.attention_norm(x), *tables, **attention_inputs)
        return h + self.feed_forward(self.ffn_norm(h))
