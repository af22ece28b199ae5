"""Causal attention, or block-causal attention over packed documents, for every model family.

A packed training sample holds several documents one after another. With plain causal
attention a token attends to the end of the previous document too; with block-causal
attention (torchtitan's `attn_mask_type = "block_causal"`) it attends only to the earlier
tokens of its own document, so each document is trained as if it were alone. Rotary
embeddings are relative, so a document's scores do not depend on where it starts either.

The caller passes `document_ids` (`[batch, seq]` int, equal ids = same document, e.g.
`document_ids(tokens, bos_id)` for documents that each start with BOS) to the model's forward;
the model builds the mask once per forward with `build_attention_mask` and every attention
layer calls `attend(q, k, v, mask)`:

- no mask: `F.scaled_dot_product_attention(is_causal=True)`, as before;
- on CUDA: FlexAttention with a `BlockMask` (only the blocks that hold allowed pairs are
  computed; its kernels are compiled by Triton, and its backward needs them);
- elsewhere (CPU): SDPA with a dense boolean `[batch, 1, seq, seq]` mask. FlexAttention has no
  backward on CPU in torch 2.15 (it raises NotImplementedError), and the dense mask gives the
  same result exactly, at O(seq^2) memory per sample, which CPU runs can afford.

The mask has no head dimension, so tensor parallel (heads split over ranks) needs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F

AttnMaskType = Literal["causal", "block_causal"]
ATTN_MASK_TYPES: tuple[str, ...] = ("causal", "block_causal")


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """`[batch, seq]` ids numbering the documents of packed `tokens`, where each document
    starts with `bos_id` (the tokens before the first BOS, a document's tail cut from the
    previous sample, get id 0)."""
    return (tokens == bos_id).cumsum(dim=-1)


@dataclass(frozen=True)
class AttentionMask:
    """The block-causal mask of one batch, in the form its device runs."""

    block_mask: object | None = None
    """FlexAttention's `BlockMask` (CUDA)."""
    dense: torch.Tensor | None = None
    """`[batch, 1, seq, seq]` bool, True where attending is allowed (other devices)."""


def build_attention_mask(ids: torch.Tensor | None) -> AttentionMask | None:
    """The block-causal mask for `document_ids` `ids` (None: plain causal attention)."""
    if ids is None:
        return None
    batch, seq = ids.shape
    if ids.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_and_causal(b, h, q, kv):
            return (q >= kv) & (ids[b, q] == ids[b, kv])

        block_mask = create_block_mask(
            same_document_and_causal, batch, None, seq, seq, device=ids.device
        )
        return AttentionMask(block_mask=block_mask)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    same = ids[:, :, None] == ids[:, None, :]
    return AttentionMask(dense=(same & causal)[:, None])


@cache
def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled once per process: eager FlexAttention materialises the scores and is slow.
    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None
) -> torch.Tensor:
    """Attention of `[batch, heads, seq, head_dim]` queries, keys and values: causal, or
    block-causal under `mask`. Keys and values may have fewer heads than the queries
    (grouped-query attention: kv head i serves query heads i*r .. (i+1)*r-1); the kernels
    read them in place, which saves the copies (and their backward sums) of repeating them."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask.block_mask is not None:
        return _flex_attention()(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)
