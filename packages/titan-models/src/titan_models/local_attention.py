"""Sliding-window and sink attention: which keys a query sees, and what its softmax sums, for
any model family and under any of the block-causal mask's implementations.

- A sliding window `window = W` (a layer's own: GPT-OSS alternates windowed and full layers,
  Gemma 3 has five windowed to one full): the query at position p sees the keys at
  p - W < k <= p, W positions with itself (Hugging Face's `sliding_window`), and under a
  block-causal mask only those of its own document.
- Sinks (`[heads]`, a learned logit per head, GPT-OSS): each query's softmax has one more
  term in its denominator and none in its numerator, so that a head may attend to nothing:
  out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)).

How each implementation computes them (`titan_models.block_causal.attend_block_causal`):
- dense, the per-document varlen path and generation (`attend_dense`): SDPA under a boolean
  mask (the window is one more condition on it), the sink as a key before the first: every
  query scores its head's sink against it, and its value is zero. Written as one more feature
  of q and k (the sink / softmax scale on the queries, 1 on that key, 0 on the others; the
  head size padded to a multiple of 8 for the kernels), so that any SDPA kernel computes it
  exactly, gradients of the sinks included.
- flex: the window in the mask function (one `BlockMask` per window the model uses, built
  with the forward's mask); the sinks through the log-sum-exp FlexAttention returns, since
  Z / (Z + exp(sink)) = sigmoid(lse - sink) scales its output.
- varlen on CUDA: flash attention's own window (`window_size=(W - 1, 0)`); with sinks, which
  no variable-length kernel takes, the per-document path (noted once per process).

`HeadSinks` holds the sinks as a module (tensor parallel splits it by heads, `per_head_param`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HeadSinks", "attend_dense", "causal_band", "window_band"]


class HeadSinks(nn.Module):
    """The attention sinks of a layer: one learned logit per query head (`weight`,
    `[heads]`); calling it returns them (the rank's own heads under tensor parallel)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads))

    def forward(self) -> torch.Tensor:
        return self.weight


def window_band(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """`[len(queries), len(keys)]` bool: key position k is visible from query position p when
    k <= p and, with a `window` W, p - k < W."""
    distance = queries[:, None] - keys[None, :]
    allowed = distance >= 0
    return allowed & (distance < window) if window is not None else allowed


def causal_band(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """`[seq, seq]` bool: `window_band` of positions 0..seq-1 against themselves."""
    positions = torch.arange(seq, device=device)
    return window_band(positions, positions, window)


def attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of `[batch, heads, seq, head_dim]` queries against keys and values (which may have
    fewer heads) under the boolean mask `allowed` (broadcastable to [batch, heads, q, k];
    None: every key), with the heads' `sinks` in each softmax (see the module)."""
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    batch, heads, seq, head_dim = q.shape
    scale = head_dim**-0.5
    width = -(-(head_dim + 1) // 8) * 8
    # The sink as key 0: query feature head_dim holds sink / scale, key 0 has 1 there and
    # nothing elsewhere, the real keys 0 there; so key 0's score is exactly the sink.
    sink = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(batch, heads, seq, 1)
    q = torch.cat([q, sink, q.new_zeros(batch, heads, seq, width - head_dim - 1)], dim=-1)
    k = F.pad(k, (0, width - head_dim))
    sink_key = torch.zeros(batch, k.shape[1], 1, width, dtype=k.dtype, device=k.device)
    sink_key[..., head_dim] = 1
    k = torch.cat([sink_key, k], dim=2)
    v = torch.cat([v.new_zeros(batch, v.shape[1], 1, v.shape[-1]), v], dim=2)
    if allowed is None:
        allowed = torch.ones(seq, k.shape[2] - 1, dtype=torch.bool, device=q.device)
    first = torch.ones((*allowed.shape[:-1], 1), dtype=torch.bool, device=allowed.device)
    allowed = torch.cat([first, allowed], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
