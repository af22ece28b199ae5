"""Rotary position embedding on real cos/sin tables, for every family.

A table is `[max_seq_len, rotary_dim]` float32: the cos of each position's angles in the first
half of the last dimension, their sin in the second. The angles are complex numbers in Meta's
reference; here they are real because DTensor, torch.compile and DCP on CPU handle complex
tensors poorly. Position is dimension 0, so context parallel can shard a table the way it
shards the sequence. A family chooses the frequencies (Llama 3.1 scaling, YaRN, none) and the
pairing of features (`apply_rope`'s interleaved pairs, or Qwen's rotate-half).
"""

from __future__ import annotations

import math

import torch


def rope_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """The `dim // 2` unscaled rotation frequencies theta^(-2i/dim) (radians per position),
    float32."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


def _dimension_of(rotations: float, dim: int, base: float, context: int) -> float:
    """The (fractional) frequency index whose wavelength fits `rotations` times in `context`."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(
    dim: int,
    theta: float,
    factor: float,
    original_seq_len: int,
    beta_fast: float,
    beta_slow: float,
    *,
    truncate: bool = True,
    device: torch.device | None = None,
) -> torch.Tensor:
    """YaRN's `dim // 2` frequencies (arXiv:2309.00071): the dimensions that turn more than
    `beta_fast` times over the original context keep theirs, those under `beta_slow` times
    are divided by `factor`, and a linear ramp blends the ones between (its ends rounded
    out to whole dimensions with `truncate`, as DeepSeek's released code does; GPT-OSS's
    does not round them)."""
    freqs = rope_frequencies(dim, theta, device)
    if factor <= 1:
        return freqs
    first = _dimension_of(beta_fast, dim, theta, original_seq_len)
    last = _dimension_of(beta_slow, dim, theta, original_seq_len)
    if truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, dim - 1)
    if first == last:
        last += 0.001  # a step, not a division by zero
    index = torch.arange(dim // 2, device=device, dtype=torch.float32)
    interpolated = ((index - first) / (last - first)).clamp(0, 1)  # 0: keep, 1: divide by factor
    return freqs * (1 - interpolated) + freqs / factor * interpolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` (1 when not extended)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_table(freqs: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """`[max_seq_len, 2 * len(freqs)]` float32: cos of every position's angles, then their sin."""
    positions = torch.arange(max_seq_len, device=freqs.device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, seq, heads, head_dim]` by the first `seq` rows of `rope_cache`, pair
    (x[2i], x[2i+1]) by angle i (Meta's interleaved convention)."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    cos, sin = rope_cache[:seq_len].unsqueeze(1).chunk(2, dim=-1)  # [seq, 1, head_dim // 2] each
    pairs = x.float().unflatten(-1, (head_dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)
