"""DeepSeek-V3: the shared decoder (`titan_models.decoder`, which documents the structure, the
pipeline hooks and the initialisation) with multi-head latent attention; the feed-forward
(`feed_forward`) is a dense SwiGLU in the first `n_dense_layers` blocks and
`titan_models.moe.MoE` (routed plus shared experts) in the others.

Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1), in training form:
- queries: `wq` (dim -> heads x qk_head_dim), or with `q_lora_rank` the low-rank
  `wq_a` (dim -> q_lora_rank) -> `q_norm` -> `wq_b` (-> heads x qk_head_dim);
- keys and values: `wkv_a` (dim -> kv_lora_rank) gives the latent, `kv_norm` -> `wkv_b`
  (kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim)) rebuilds each head's position-free
  key and its value; `wk_rope` (dim -> qk_rope_head_dim) gives the rotary key part, one shared
  by every head. DeepSeek's checkpoints hold wkv_a and wk_rope as one matrix; they are two
  modules here because tensor parallel treats them differently (see `tp_plan`);
- each head's query and key are [position-free part, rotary part]; the logits are scaled by
  `softmax_scale(args)` (YaRN's mscale included), causal; `wo` maps heads x v_head_dim back.
Multi-token prediction (the paper's MTP modules) is the shared decoder's (`titan_models.mtp`),
on with `n_mtp_layers`. Generation caches each head's full keys and values
(`titan_models.generation.KVCache`), not the compressed latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.model_protocols import HeadAttention, QKClipLayout, QKClipRows
from titan_core.protocols import TPStyle
from titan_models.decoder import Decoder
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.flops import deepseek_v3_flops_per_token
from titan_models.deepseek_v3.rope import build_rope_cache, softmax_scale
from titan_models.generation import KVCache, LayerCache, causal_mask
from titan_models.moe import MoEArgs
from titan_models.rope import apply_rope

LATENT_NORM_EPS = 1e-6  # q_norm and kv_norm, as in DeepSeek's and Hugging Face's code


class MultiHeadLatentAttention(nn.Module, HeadAttention):
    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        self.scale = softmax_scale(args)
        qk_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, qk_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank, bias=False)
        self.wk_rope = nn.Linear(args.dim, args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)

    @classmethod
    def init_plan(cls, args: DeepSeekV3Args, std: float, out_std: float) -> dict[str, ParamInit]:
        """How the parameters start, by name relative to the attention: the latent norms at 1,
        `out_std` for `wo` (it writes into the residual stream), `std` for the projections."""
        norms = ["kv_norm", "q_norm"] if args.q_lora_rank else ["kv_norm"]
        plan = {f"{n}.weight": ParamInit("constant", value=1.0) for n in norms}
        queries = ["wq_a", "wq_b"] if args.q_lora_rank else ["wq"]
        for name in [*queries, "wkv_a", "wk_rope", "wkv_b"]:
            plan[f"{name}.weight"] = ParamInit.truncated(std)
        return plan | {"wo.weight": ParamInit.truncated(out_std)}

    @classmethod
    def tp_plan(cls, args: DeepSeekV3Args) -> dict[str, TPStyle]:
        """The per-head projections (wq or wq_b, wkv_b) split by heads, wo by its input; the
        latent projections and their norms (small, shared by all heads) stay whole on every
        rank, and so does the rotary key, whose gradient (each rank's from its own heads) is
        summed over the ranks (`head_shared`)."""
        query = "wq_b" if args.q_lora_rank else "wq"
        return {query: "colwise", "wkv_b": "colwise", "wk_rope": "head_shared", "wo": "rowwise"}

    @classmethod
    def divisible_by_tp(cls, args: DeepSeekV3Args) -> dict[str, int]:
        return {"n_heads": args.n_heads}

    def attention_heads(self) -> tuple[int, int]:
        return self.args.n_heads, self.args.n_heads  # every head has its own key and value

    def qk_clip_layout(self) -> QKClipLayout:
        """QK-Clip's view (titan_core.HeadAttention): each head's query is its position-free
        part then its rotary part (wq or wq_b), its key the position-free part of its block of
        wkv_b (the values follow); the rotary key (wk_rope) is every head's, so it is never
        scaled and the rotary query takes the head's whole factor."""
        a = self.args
        query = self.wq_b if a.q_lora_rank else self.wq
        q_parts = (("q", a.qk_nope_head_dim), ("q_alone", a.qk_rope_head_dim))
        kv_parts = (("k", a.qk_nope_head_dim), ("none", a.v_head_dim))
        return QKClipLayout(
            self.scale,
            (
                QKClipRows(query.weight, "query", q_parts),
                QKClipRows(self.wkv_b.weight, "kv", kv_parts),
            ),
        )

    def attend(self, q, k, v, mask: None) -> torch.Tensor:
        """Training: causal attention of `[batch, heads, seq, head_dim]` (no document masks)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """`rope_cache` holds the rows of x's positions. With `kv_cache` (generation), x's
        positions start at `start` and attend to the cached ones before them too."""
        a = self.args
        batch, seq_len, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        # -1 heads: tensor parallel leaves each rank its own heads of wq(_b) and wkv_b.
        q = q.view(batch, seq_len, -1, a.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(self.wkv_a(x))).view(
            batch, seq_len, -1, a.qk_nope_head_dim + a.v_head_dim
        )
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope_cache)
        k_rope = apply_rope(self.wk_rope(x).unsqueeze(2), rope_cache)  # one for all heads
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # Values padded with zeros to the query/key size: the fused attention kernels (flash
        # on CUDA and CPU, and context parallel's ring attention over them) want one head size
        # for q, k and v; the zeros add nothing and are cut off again.
        pad = a.qk_head_dim - a.v_head_dim
        if pad > 0:
            v = F.pad(v, (0, pad))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if kv_cache is None:
            out = self.attend(q, k, v, None)
        else:
            mask = causal_mask(start, seq_len, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out[..., : a.v_head_dim] if pad > 0 else out
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class DeepSeekV3Transformer(Decoder):
    """DeepSeek-V3 decoder (see `Decoder`: built on meta, then `to_empty` and `init_weights`),
    including generation with `kv_cache=`."""

    args: DeepSeekV3Args
    attention_class = MultiHeadLatentAttention

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return {"rope_cache": build_rope_cache(self.args, device)}

    def moe_args(self, layer_id: int) -> MoEArgs | None:
        return self.args.moe if self.args.is_moe_layer(layer_id) else None

    def forward(self, tokens: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Logits (see `Decoder.forward`), without `document_ids`: this attention takes no
        block-causal mask, so the trainer refuses `attn_mask_type = "block_causal"` for it."""
        return super().forward(tokens, kv_cache)

    def flops_per_token(self, seq_len: int) -> float:
        return deepseek_v3_flops_per_token(self.args, seq_len)
