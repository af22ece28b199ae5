"""Rotary embedding of MLA's positional part, with YaRN frequency scaling (arXiv:2309.00071).

The table has Titan's layout (`titan_models.rope`: `[max_seq_len, qk_rope_head_dim]`, cos then
sin) and is applied with Meta's interleaved-pair rotation (`titan_models.rope.apply_rope`), as
DeepSeek's own code and Hugging Face's `rope_interleave` do.

YaRN keeps the dimensions that turn many times over the original context (high frequencies,
local order) and divides the frequencies of the slow ones by `rope_factor`, with a linear
blend over the dimensions between `beta_fast` and `beta_slow` rotations. The scaling is on
whenever `rope_factor > 1`, whatever the sequence length, as in Hugging Face's DeepseekV3
(the released checkpoints' function); the softmax scale grows with it (`softmax_scale`).
"""

from __future__ import annotations

import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.rope import rope_table, yarn_frequencies, yarn_mscale


def build_rope_frequencies(
    args: DeepSeekV3Args, device: torch.device | None = None
) -> torch.Tensor:
    """The `qk_rope_head_dim // 2` rotation frequencies (radians per position), float32."""
    return yarn_frequencies(
        args.qk_rope_head_dim,
        args.rope_theta,
        args.rope_factor,
        args.original_seq_len,
        args.beta_fast,
        args.beta_slow,
        device=device,
    )


def build_rope_cache(args: DeepSeekV3Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, qk_rope_head_dim]` float32: cos of the angles, then their sin."""
    return rope_table(build_rope_frequencies(args, device), args.max_seq_len)


def softmax_scale(args: DeepSeekV3Args) -> float:
    """The attention logits' scale: 1/sqrt(qk_head_dim), times YaRN's mscale squared."""
    return args.qk_head_dim**-0.5 * yarn_mscale(args.rope_factor, args.mscale) ** 2
