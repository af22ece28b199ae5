"""Rotary position embedding with Llama 3.1 frequency scaling, on real cos/sin tensors.

Meta's convention rotates interleaved pairs (x[2i], x[2i+1]) of each head by angle
position * freq[i]. The reference keeps the angles as complex numbers; here they are a real
table `[max_seq_len, head_dim]` holding cos in the first half of the last dim and sin in the
second, because DTensor, torch.compile and DCP on CPU handle complex tensors poorly. Position
is dim 0, so context parallel can shard the table the way it shards the sequence.
"""

from __future__ import annotations

import math

import torch

from titan_models.llama3.args import LlamaArgs


def build_rope_frequencies(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """The `head_dim // 2` rotation frequencies (radians per position), float32."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    freqs = 1.0 / (args.rope_theta**exponents)
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
    freqs = build_rope_frequencies(args, device)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, seq, heads, head_dim]` by the first `seq` rows of `rope_cache`."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    cos, sin = rope_cache[:seq_len].unsqueeze(1).chunk(2, dim=-1)  # [seq, 1, head_dim // 2] each
    pairs = x.float().unflatten(-1, (head_dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
