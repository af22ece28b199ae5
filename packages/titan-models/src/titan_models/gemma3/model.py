"""Gemma 3 (text): the shared decoder (`titan_models.decoder`, which documents the structure,
the pipeline hooks and the initialisation) with Gemma's own pieces (see
`titan_models.gemma3.args`): a scaled embedding, (1 + w) RMSNorms, "sandwich" blocks of four
norms, GeGLU feed-forwards, QK-norm, rotate-half rotary embeddings with a local and a global
table, and local blocks that attend over a sliding window (`Gemma3Args.attention_window`,
which the shared attention reads).

Initialisation as the shared decoder's, except that every norm weight w starts at 0 (a scale
of 1) and the tied embedding, which the sqrt(dim) factor scales up, starts at std dim**-0.5
like an output projection (so the embedded tokens have unit scale too).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPPlan, TPStyle
from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder
from titan_models.gemma3.args import Gemma3Args
from titan_models.gemma3.flops import gemma3_flops_per_token
from titan_models.moe import SwiGLU
from titan_models.qwen3.model import apply_rope
from titan_models.rope import rope_frequencies, rope_table

_ZERO = ParamInit("constant", value=0.0)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), in float32 whatever the input's dtype, back in it.
    Over the last dimension: a block's width, or each head's features (QK-norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).type_as(x)


class ScaledEmbedding(nn.Embedding):
    """An embedding multiplied by sqrt(embedding_dim), the factor rounded to the table's
    dtype first (as Gemma's reference does: in bf16, 16 * sqrt(dim) is not exact)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        scale = math.sqrt(embedding_dim)
        # Python floats by dtype, rounded once here: no tensor made in the (compiled) forward.
        self.scales = {
            dtype: torch.tensor(scale, dtype=dtype, device="cpu").item()
            for dtype in (torch.float32, torch.bfloat16, torch.float16)
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = super().forward(tokens)
        return h * self.scales.get(h.dtype, math.sqrt(self.embedding_dim))


class GeGLU(SwiGLU):
    """w2(gelu_tanh(w1 x) * w3 x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


def build_rope_cache(
    args: Gemma3Args, theta: float, scaling: float, device: torch.device | None = None
) -> torch.Tensor:
    """`[max_seq_len, head_dim]` float32 (cos, then sin), frequencies divided by `scaling`
    (linear scaling)."""
    freqs = rope_frequencies(args.head_dim, theta, device) / scaling
    return rope_table(freqs, args.max_seq_len)


class Attention(GroupedQueryAttention):
    """Grouped-query attention with Gemma's QK-norm, the rotary table of its kind of block
    (local or global), and scores scaled by query_pre_attn_scalar**-0.5: the queries are
    multiplied by the ratio to head_dim**-0.5, which the shared attention applies."""

    def __init__(self, layer_id: int, args: Gemma3Args):
        super().__init__(layer_id, args)
        self.normalises_qk = True
        self.q_norm = GemmaRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, eps=args.norm_eps)
        self.is_global = args.is_global(layer_id)
        self.query_scale = math.sqrt(args.head_dim / args.query_pre_attn_scalar)

    @classmethod
    def init_plan(cls, args, std: float, out_std: float) -> dict[str, ParamInit]:
        norms = {f"{n}.weight": _ZERO for n in ("q_norm", "k_norm")}
        return super().init_plan(args, std, out_std) | norms

    @classmethod
    def tp_plan(cls, args) -> dict[str, TPStyle]:
        return super().tp_plan(args) | {"q_norm": "per_head", "k_norm": "per_head"}

    def position(
        self, q: torch.Tensor, k: torch.Tensor, global_rope: torch.Tensor, local_rope: torch.Tensor
    ):
        table = global_rope if self.is_global else local_rope
        q, k = apply_rope(self.q_norm(q), table), apply_rope(self.k_norm(k), table)
        return (q if self.query_scale == 1.0 else q * self.query_scale), k


class Gemma3Block(nn.Module):
    """Norm -> attention -> norm -> residual, norm -> GeGLU -> norm -> residual."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = GemmaRMSNorm(dim, norm_eps)
        self.attention = attention
        self.post_attention_norm = GemmaRMSNorm(dim, norm_eps)
        self.ffn_norm = GemmaRMSNorm(dim, norm_eps)
        self.feed_forward = feed_forward
        self.post_ffn_norm = GemmaRMSNorm(dim, norm_eps)

    def forward(self, x: torch.Tensor, *tables: torch.Tensor, **attention_inputs) -> torch.Tensor:
        attended = self.attention(self.attention_norm(x), *tables, **attention_inputs)
        h = x + self.post_attention_norm(attended)
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


_BLOCK_NORMS = ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm")


class Gemma3Transformer(Decoder):
    """Gemma 3 text decoder (see `Decoder`: built on meta, then `to_empty` and
    `init_weights`)."""

    args: Gemma3Args
    attention_class = Attention

    def __init__(self, args: Gemma3Args):
        super().__init__(args)
        self.tok_embeddings = ScaledEmbedding(args.vocab_size, args.dim)
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self._tie_weights()

    def build_block(self, layer_id: int) -> nn.Module:
        args = self.args
        attention = self.attention_class(layer_id, args)
        return Gemma3Block(args.dim, args.norm_eps, attention, GeGLU(args.dim, args.hidden_dim))

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        a = self.args
        return {
            "rope_global": build_rope_cache(a, a.rope_theta, a.rope_scaling_factor, device),
            "rope_local": build_rope_cache(a, a.rope_local_theta, 1.0, device),
        }

    def block_init_plan(self, layer_id: int) -> dict[str, ParamInit]:
        plan = super().block_init_plan(layer_id)
        return plan | {f"{n}.weight": _ZERO for n in _BLOCK_NORMS}

    def init_plan(self) -> dict[str, ParamInit]:
        plan = super().init_plan()
        plan["norm.weight"] = _ZERO
        if not self.args.tie_word_embeddings:  # else the shared matrix's std dim**-0.5
            plan["tok_embeddings.weight"] = ParamInit.truncated(self.args.dim**-0.5)
        return plan

    def tp_plan(self) -> TPPlan:
        plan = super().tp_plan()
        # After the sequence-parallel projections (wo, w2) and before the residual adds:
        # norms of each rank's tokens that hand on plain tensors, as the blocks pass them.
        post = {"post_attention_norm": "per_token", "post_ffn_norm": "per_token"}
        return dataclasses.replace(plan, block=plan.block | post)

    def flops_per_token(self, seq_len: int) -> float:
        return gemma3_flops_per_token(self.args, seq_len)
