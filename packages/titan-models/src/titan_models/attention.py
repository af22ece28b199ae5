"""Attention for every model family: the grouped-query attention module most of them build on,
and causal or block-causal attention over packed documents.

`GroupedQueryAttention` is Llama 3's attention (wq, wk, wv -> rotary embedding -> causal
attention -> wo, k and v with fewer heads than q); a family changes one step by overriding it:
how queries and keys get their positions (`position`: Qwen3's QK-norm and rotate-half, Llama
4's global blocks), or how they attend (`attend`, `attend_cached`: Llama 4's chunks).

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

`check_block_causal(device)` computes block-causal attention the way a model on `device`
does (FlexAttention on CUDA) and compares it with the dense mask on the same device, forward
and backward, in float32 and bfloat16, on a small packed batch whose inputs are drawn on the
CPU (so every device sees the same numbers). The trainer runs it before training with
`block_causal` and refuses to train on a device where it fails. On the CPU it can take the
FlexAttention path too (`flex=True`, forward only), which is how the CUDA path is tested
without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPStyle
from titan_models.generation import LayerCache, causal_mask
from titan_models.rope import apply_rope

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


def build_attention_mask(
    ids: torch.Tensor | None, *, flex: bool | None = None
) -> AttentionMask | None:
    """The block-causal mask for `document_ids` `ids` (None: plain causal attention): a
    FlexAttention `BlockMask` on CUDA (or wherever `flex` asks for one), else a dense mask."""
    if ids is None:
        return None
    batch, seq = ids.shape
    if flex if flex is not None else ids.device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        # One mask per batch row (B = batch, documents differ between rows), shared by every
        # head (H = None), built on the device of `ids`, the tensor the mask function reads.
        block_mask = create_block_mask(
            same_document_and_causal(ids), batch, None, seq, seq, device=ids.device
        )
        return AttentionMask(block_mask=block_mask)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    same = ids[:, :, None] == ids[:, None, :]
    return AttentionMask(dense=(same & causal)[:, None])


def same_document_and_causal(ids: torch.Tensor):
    """FlexAttention's mask function for `document_ids` `ids`: query `q` of batch row `b`
    sees key `kv` when `kv` is not later and is in the same document."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    return mask_mod


@cache
def _flex_attention(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":  # CPU: forward only, and compiling it costs minutes there
        return flex_attention
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
        flex = _flex_attention(q.device.type)
        return flex(q, k, v, block_mask=mask.block_mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=gqa)


# The check's batch: two rows with different document boundaries (the mask is per row), the
# first starting inside a document, 300 positions (two blocks of 128 and a ragged third).
_CHECK_DOCUMENTS = ((5, 40, 100, 60, 95), (150, 1, 149))
_CHECK_HEADS, _CHECK_KV_HEADS, _CHECK_HEAD_DIM = 4, 2, 16
# Largest error allowed, as a fraction of the reference's largest value: float32 kernels sum
# in other orders (and a GPU may use TF32, ~1e-3 relative); bfloat16 keeps 8 bits (2^-8 =
# 4e-3 per rounding, a few roundings deep). A mask that lets one document see another moves
# the result by a good fraction of its scale (the CPU test measures it).
CHECK_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def check_block_causal(
    device: torch.device, *, flex: bool | None = None, backward: bool | None = None
) -> list[str]:
    """Block-causal attention as a model on `device` computes it (`build_attention_mask` and
    `attend`: FlexAttention on CUDA), against SDPA with the dense mask on the same device in
    float32, forward and (by default where the path has one) backward, in float32 and
    bfloat16. One line per disagreement; empty when it agrees."""
    device = torch.device(device)
    flex = device.type == "cuda" if flex is None else flex
    backward = not (flex and device.type == "cpu") if backward is None else backward
    ids = torch.cat(
        [
            torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
            for lengths in _CHECK_DOCUMENTS
        ]
    ).to(device)
    batch, seq = ids.shape
    g = torch.Generator().manual_seed(0)  # drawn on the CPU: the same numbers on any device
    shapes = {"q": _CHECK_HEADS, "k": _CHECK_KV_HEADS, "v": _CHECK_KV_HEADS, "out": _CHECK_HEADS}
    drawn = {n: torch.randn(batch, h, seq, _CHECK_HEAD_DIM, generator=g) for n, h in shapes.items()}
    problems = []
    mask = build_attention_mask(ids, flex=flex)
    dense = build_attention_mask(ids, flex=False)
    for dtype, tolerance in CHECK_TOLERANCE.items():
        inputs = {n: drawn[n].to(device, dtype, copy=True).requires_grad_(backward) for n in "qkv"}
        ref_inputs = {n: t.detach().float().requires_grad_(backward) for n, t in inputs.items()}
        with torch.set_grad_enabled(backward):
            out = attend(*inputs.values(), mask)
            ref = attend(*ref_inputs.values(), dense)
        results = {"forward": (out, ref)}
        if backward:
            weights = drawn["out"].to(device)
            (out.float() * weights).sum().backward()
            (ref * weights).sum().backward()
            for n in "qkv":
                results[f"d{n}"] = (inputs[n].grad, ref_inputs[n].grad)
        for what, (got, want) in results.items():
            error = (got.float() - want).abs().max().item()
            scale = want.abs().max().item()
            if not error <= tolerance * scale:  # also catches NaN
                problems.append(
                    f"{dtype} {what}: greatest difference {error:.3g} against the dense mask's"
                    f" result (largest value {scale:.3g}; allowed {tolerance:g} of it)"
                )
    return problems


class GroupedQueryAttention(nn.Module):
    """Llama 3's attention, built as `GroupedQueryAttention(layer_id, args)` from any args with
    `dim`, `n_heads`, `kv_heads` and `head_dim`.

    Heads are reshaped with -1, so tensor parallel can shard them (both head counts alike).
    `forward(x, *tables, kv_cache=None, start=0, mask=None)`: `tables` are the rows of the
    model's position tables for x's positions (the rotary table, in `position`). With
    `kv_cache` (generation) x's positions start at `start` and attend to the cached ones
    before them too; `mask` (training on packed documents) makes the attention block-causal.
    """

    def __init__(self, layer_id: int, args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads  # unchanged by TP: both head counts are sharded
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    @classmethod
    def init_plan(cls, args, std: float, out_std: float) -> dict[str, ParamInit]:
        """How the parameters start, by name relative to the attention: `out_std` for `wo`
        (it writes into the residual stream), `std` for the rest."""
        plan = {f"{n}.weight": ParamInit.truncated(std) for n in ("wq", "wk", "wv")}
        return plan | {"wo.weight": ParamInit.truncated(out_std)}

    @classmethod
    def tp_plan(cls, args) -> dict[str, TPStyle]:
        """How tensor parallel splits it, by name relative to the attention: by heads."""
        return {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}

    @classmethod
    def divisible_by_tp(cls, args) -> dict[str, int]:
        return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads}

    def position(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor):
        """Queries and keys `[batch, seq, heads, head_dim]` with their positions: Meta's
        interleaved rotary embedding."""
        return apply_rope(q, rope_cache), apply_rope(k, rope_cache)

    def attend(self, q, k, v, mask: AttentionMask | None) -> torch.Tensor:
        """Training: `[batch, heads, seq, head_dim]`, causal or block-causal under `mask`."""
        return attend(q, k, v, mask)

    def attend_cached(self, q, k, v, start: int) -> torch.Tensor:
        """Generation: queries at `start`.. against every cached key up to their own."""
        mask = causal_mask(start, q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_rep > 1)

    def forward(
        self,
        x: torch.Tensor,
        *tables: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = self.position(q, k, *tables)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # [batch, heads, seq, head_dim]; kv head i serves query heads i*n_rep .. (i+1)*n_rep-1,
        # which the attention kernels read in place (no repeated copy of k and v).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v, mask) if kv_cache is None else self.attend_cached(q, k, v, start)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
