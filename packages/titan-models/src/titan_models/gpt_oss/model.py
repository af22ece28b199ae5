"""GPT-OSS: the shared decoder (`titan_models.decoder`, which documents the structure, the
pipeline hooks and the initialisation) with the differences listed in `gpt_oss/args.py`. The
attention is `GroupedQueryAttention` with its biases, sinks and window switched on by the args
(the shared mechanisms: `titan_models.local_attention`), positions from a YaRN table in the
rotate-half pairing whose cos and sin carry YaRN's attention factor; every block's
feed-forward is a `titan_models.moe.MoE` with router and expert biases and the clamped SwiGLU.
"""

from __future__ import annotations

import torch

from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder
from titan_models.gpt_oss.args import GptOssArgs
from titan_models.gpt_oss.flops import gpt_oss_flops_per_token
from titan_models.moe import MoEArgs
from titan_models.qwen3.model import apply_rope
from titan_models.rope import rope_table, yarn_frequencies, yarn_mscale


def build_rope_cache(args: GptOssArgs, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, head_dim]` float32: cos of the YaRN angles, then sin, both times YaRN's
    attention factor (so each of q and k carries its square root of the logits' scale)."""
    freqs = yarn_frequencies(
        args.head_dim,
        args.rope_theta,
        args.rope_factor,
        args.original_seq_len,
        args.beta_fast,
        args.beta_slow,
        truncate=False,
        device=device,
    )
    return rope_table(freqs, args.max_seq_len) * yarn_mscale(args.rope_factor)


class Attention(GroupedQueryAttention):
    """Grouped-query attention (biases, sinks and window from the args) with GPT-OSS's
    rotate-half rotary embedding."""

    def position(self, q: torch.Tensor, k: torch.Tensor, rope_cache: torch.Tensor):
        return apply_rope(q, rope_cache), apply_rope(k, rope_cache)


class GptOssTransformer(Decoder):
    """GPT-OSS decoder (see `Decoder`: built on meta, then `to_empty` and `init_weights`)."""

    args: GptOssArgs
    attention_class = Attention

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return {"rope_cache": build_rope_cache(self.args, device)}

    def moe_args(self, layer_id: int) -> MoEArgs | None:
        return self.args.moe  # every block

    def flops_per_token(self, seq_len: int) -> float:
        return gpt_oss_flops_per_token(self.args, seq_len)
