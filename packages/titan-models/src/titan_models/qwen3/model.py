"""Qwen3 (dense and mixture-of-experts): the shared decoder (`titan_models.decoder`, which
documents the structure, the pipeline hooks and the initialisation) with Llama 3's
grouped-query attention changed in two steps: QK-norm (an RMSNorm over each query and key
head before the rotary embedding), and the rotary embedding in the rotate-half convention of
Qwen's own code (so Hugging Face weights load unpermuted). The head size is given, not dim /
heads, and the MoE flavors have `titan_models.moe.MoE` in place of the dense feed-forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_core.init import ParamInit
from titan_core.protocols import TPStyle
from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder
from titan_models.moe import MoEArgs
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.flops import qwen3_flops_per_token
from titan_models.rope import rope_frequencies, rope_table


def build_rope_cache(args: Qwen3Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, head_dim]` float32: cos of the angles (head_dim // 2 of them), then sin."""
    return rope_table(rope_frequencies(args.head_dim, args.rope_theta, device), args.max_seq_len)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, seq, heads, head_dim]`: element i of the first half pairs with
    element i of the second half (rotate-half)."""
    cos, sin = rope_cache[: x.shape[1]].unsqueeze(1).chunk(2, dim=-1)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)


class HeadNorm(torch.nn.RMSNorm):
    """QK-norm: an RMSNorm over each head's features of [batch, seq, heads, head_dim], in
    float32 whatever the compute dtype (the projections' output may be bf16 and the scale
    fp32, or the reverse under FSDP's mixed precision), back in x's dtype. A module call, so
    that tensor parallel can hook it (TPStyle `per_head`: each rank normalises its own heads
    with the one shared weight, whose gradient is summed over the ranks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).type_as(x)


class Attention(GroupedQueryAttention):
    """Grouped-query attention with QK-norm and rotate-half rotary embedding."""

    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__(layer_id, args)
        self.normalises_qk = True
        self.q_norm = HeadNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = HeadNorm(args.head_dim, eps=args.norm_eps)

    @classmethod
    def init_plan(cls, args, std: float, out_std: float) -> dict[str, ParamInit]:
        norms = {f"{n}.weight": ParamInit("constant", value=1.0) for n in ("q_norm", "k_norm")}
        return super().init_plan(args, std, out_std) | norms

    @classmethod
    def tp_plan(cls, args) -> dict[str, TPStyle]:
        return super().tp_plan(args) | {"q_norm": "per_head", "k_norm": "per_head"}

    def position(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor):
        return apply_rope(self.q_norm(q), rope_cache), apply_rope(self.k_norm(k), rope_cache)


class Qwen3Transformer(Decoder):
    """Qwen3 decoder (see `Decoder`: built on meta, then `to_empty` and `init_weights`)."""

    args: Qwen3Args
    attention_class = Attention

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return {"rope_cache": build_rope_cache(self.args, device)}

    def moe_args(self, layer_id: int) -> MoEArgs | None:
        return self.args.moe  # every block, or none

    def flops_per_token(self, seq_len: int) -> float:
        return qwen3_flops_per_token(self.args, seq_len)
