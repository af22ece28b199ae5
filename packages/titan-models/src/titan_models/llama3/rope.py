"""Llama 3.1's rotary embedding: Meta's interleaved pairs (`titan_models.rope.apply_rope`)
at frequencies stretched for long context (`build_rope_frequencies`); see `titan_models.rope`
for the table's layout."""

from __future__ import annotations

import math

import torch

from titan_models.llama3.args import LlamaArgs
from titan_models.rope import apply_rope, rope_frequencies, rope_table

__all__ = ["apply_rope", "build_rope_cache", "build_rope_frequencies"]


def build_rope_frequencies(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """The `head_dim // 2` rotation frequencies (radians per position), float32."""
    freqs = rope_frequencies(args.head_dim, args.rope_theta, device)
    if not args.use_rope_scaling:
        return freqs
    # Llama 3.1: wavelengths longer than the original context are stretched by `factor`,
    # short ones are kept, and the band in between is blended linearly in 1/wavelength.
    factor = args.rope_scaling_factor
    original = args.rope_original_max_seq_len
    low_freq_wavelen = original / args.rope_low_freq_factor
    high_freq_wavelen = original / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def build_rope_cache(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, head_dim]` float32: cos of the angles, then their sin."""
    return rope_table(build_rope_frequencies(args, device), args.max_seq_len)
