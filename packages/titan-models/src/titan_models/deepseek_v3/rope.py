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

import math

import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.rope import rope_frequencies, rope_table


def _dimension_of(rotations: float, dim: int, base: float, context: int) -> float:
    """The (fractional) frequency index whose wavelength fits `rotations` times in `context`."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def build_rope_frequencies(
    args: DeepSeekV3Args, device: torch.device | None = None
) -> torch.Tensor:
    """The `qk_rope_head_dim // 2` rotation frequencies (radians per position), float32."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freqs = rope_frequencies(dim, base, device)
    if args.rope_factor <= 1:
        return freqs
    first = max(math.floor(_dimension_of(args.beta_fast, dim, base, args.original_seq_len)), 0)
    last = min(math.ceil(_dimension_of(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
    if first == last:
        last += 0.001  # a step, not a division by zero
    index = torch.arange(dim // 2, device=device, dtype=torch.float32)
    interpolated = ((index - first) / (last - first)).clamp(0, 1)  # 0: keep, 1: divide by factor
    return freqs * (1 - interpolated) + freqs / args.rope_factor * interpolated


def build_rope_cache(args: DeepSeekV3Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, qk_rope_head_dim]` float32: cos of the angles, then their sin."""
    return rope_table(build_rope_frequencies(args, device), args.max_seq_len)


def softmax_scale(args: DeepSeekV3Args) -> float:
    """The attention logits' scale: 1/sqrt(qk_head_dim), times YaRN's mscale squared."""
    scale = args.qk_head_dim**-0.5
    if args.rope_factor > 1:
        scale *= (0.1 * args.mscale * math.log(args.rope_factor) + 1.0) ** 2
    return scale
