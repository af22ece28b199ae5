"""Attention for every model family: the grouped-query attention module most of them build on,
and causal or block-causal attention over packed documents.

`GroupedQueryAttention` is Llama 3's attention (wq, wk, wv -> rotary embedding -> causal
attention -> wo, k and v with fewer heads than q); a family changes one step by overriding it:
how queries and keys get their positions (`position`: Qwen3's QK-norm and rotate-half, Llama
4's global blocks), or how they attend (`attend`, `attend_cached`: Llama 4's chunks).

Block-causal attention over packed documents (`document_ids`, `build_attention_mask`, the
dense / FlexAttention / variable-length implementations and `check_block_causal`) lives in
`titan_models.block_causal`; its names are importable from here too. Every attention layer
calls `attend(q, k, v, mask)`: SDPA `is_causal=True` without a mask, the mask's own
implementation with one. Which SDPA kernel runs the causal case is torch's choice unless the
layer's `sdpa_backend` names one (it is a `TakesSDPAKernel`; `titan_models.attention_backend`,
measured per shape).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.model_protocols import HeadAttention, QKClipLayout, QKClipRows
from titan_core.protocols import TPStyle
from titan_models.attention_backend import SDPAChoice, TakesSDPAKernel, run_attention
from titan_models.block_causal import (
    BLOCK_CAUSAL_IMPLS,
    CHECK_TOLERANCE,
    AttentionMask,
    BlockCausalImpl,
    attend_block_causal,
    attend_flex,
    build_attention_mask,
    causal_block_mask,
    check_block_causal,
    document_ids,
    same_document_and_causal,
)
from titan_models.generation import LayerCache, causal_mask
from titan_models.local_attention import HeadSinks, attend_dense, causal_band, window_band
from titan_models.rope import apply_rope

__all__ = [
    "ATTN_MASK_TYPES",
    "BLOCK_CAUSAL_IMPLS",
    "CHECK_TOLERANCE",
    "AttentionMask",
    "AttnMaskType",
    "BlockCausalImpl",
    "GroupedQueryAttention",
    "attend",
    "build_attention_mask",
    "check_block_causal",
    "document_ids",
    "same_document_and_causal",
]

AttnMaskType = Literal["causal", "block_causal"]
ATTN_MASK_TYPES: tuple[str, ...] = ("causal", "block_causal")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask | None,
    backend: SDPAChoice | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `[batch, heads, seq, head_dim]` queries, keys and values: causal, or
    block-causal under `mask`. Keys and values may have fewer heads than the queries
    (grouped-query attention: kv head i serves query heads i*r .. (i+1)*r-1); the kernels
    read them in place, which saves the copies (and their backward sums) of repeating them.
    `backend`: the SDPA kernel of the causal case (None: torch's dispatch picks). `window`:
    a sliding window of that many positions; `sinks`: the heads' sink logits `[heads]`
    (`titan_models.local_attention`)."""
    if mask is not None:
        return attend_block_causal(q, k, v, mask, window=window, sinks=sinks)
    if window is None and sinks is None:
        return run_attention(q, k, v, backend)
    if q.device.type == "cuda":  # FlexAttention with a mask of positions alone, made once
        return attend_flex(q, k, v, causal_block_mask(q.shape[2], window, q.device), sinks)
    return attend_dense(q, k, v, causal_band(q.shape[2], window, q.device), sinks)


class GroupedQueryAttention(nn.Module, TakesSDPAKernel, HeadAttention):
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
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias)
        self.heads = (args.n_heads, args.kv_heads)
        self.normalises_qk = False
        """Whether the heads are normalised after the projections (QK-norm; a family's)."""
        self.window: int | None = args.attention_window(layer_id)
        """This layer's sliding window (None: every earlier position)."""
        self.sinks = HeadSinks(args.n_heads) if args.attention_sinks else None

    def attention_heads(self) -> tuple[int, int]:
        return self.heads

    @classmethod
    def init_plan(cls, args, std: float, out_std: float) -> dict[str, ParamInit]:
        """How the parameters start, by name relative to the attention: `out_std` for `wo`
        (it writes into the residual stream), `std` for the rest."""
        plan = {f"{n}.weight": ParamInit.truncated(std) for n in ("wq", "wk", "wv")}
        if args.attention_sinks:
            plan["sinks.weight"] = ParamInit.truncated(std)
        if args.attention_bias:
            plan |= {f"w{p}.bias": ParamInit("constant", value=0.0) for p in "qkvo"}
        return plan | {"wo.weight": ParamInit.truncated(out_std)}

    @classmethod
    def tp_plan(cls, args) -> dict[str, TPStyle]:
        """How tensor parallel splits it, by name relative to the attention: by heads."""
        plan: dict[str, TPStyle] = {"wq": "colwise", "wk": "colwise", "wv": "colwise"}
        if args.attention_sinks:
            plan["sinks"] = "per_head_param"
        return plan | {"wo": "rowwise"}

    @classmethod
    def divisible_by_tp(cls, args) -> dict[str, int]:
        return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads}

    @classmethod
    def sdpa_heads(cls, args) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size) its causal attention runs, before tensor
        parallel splits the heads: the shape an SDPA kernel is chosen for."""
        return args.n_heads, args.kv_heads, args.head_dim

    def position(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor):
        """Queries and keys `[batch, seq, heads, head_dim]` with their positions: Meta's
        interleaved rotary embedding."""
        return apply_rope(q, rope_cache), apply_rope(k, rope_cache)

    def attend(self, q, k, v, mask: AttentionMask | None) -> torch.Tensor:
        """Training: `[batch, heads, seq, head_dim]`, causal or block-causal under `mask`,
        within the layer's window, with its sinks."""
        return attend(q, k, v, mask, self.sdpa_backend, window=self.window, sinks=self._sinks())

    def attend_cached(self, q, k, v, start: int) -> torch.Tensor:
        """Generation: queries at `start`.. against every cached key up to their own (within
        the layer's window, with its sinks)."""
        if self.window is None and self.sinks is None:
            mask = causal_mask(start, q.shape[2], q.device)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.n_rep > 1
            )
        queries = torch.arange(start, start + q.shape[2], device=q.device)
        allowed = window_band(queries, torch.arange(k.shape[2], device=q.device), self.window)
        return attend_dense(q, k, v, allowed, self._sinks())

    def _sinks(self) -> torch.Tensor | None:
        """This rank's heads' sink logits, or None without sinks."""
        return self.sinks() if self.sinks is not None else None

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

    def qk_clip_layout(self) -> QKClipLayout:
        """QK-Clip's view (titan_core.HeadAttention): SDPA's default scale; wq's rows (and
        bias) by query head, wk's by key/value head; the layer's window. Refused where the
        heads are normalised after the projections (QK-norm), which would undo the scaling."""
        if self.normalises_qk:
            raise NotImplementedError(
                f"{type(self).__name__} normalises each query and key head after its projection"
                " (QK-norm), which undoes any scaling of the projections: QK-Clip cannot bound"
                " its logits (QK-norm bounds them itself)"
            )
        d = self.head_dim
        rows = [QKClipRows(self.wq.weight, "query", (("q", d),)),
                QKClipRows(self.wk.weight, "kv", (("k", d),))]  # fmt: skip
        if self.wq.bias is not None:
            rows += [QKClipRows(self.wq.bias, "query", (("q", d),)),
                     QKClipRows(self.wk.bias, "kv", (("k", d),))]  # fmt: skip
        return QKClipLayout(d**-0.5, tuple(rows), self.window)
