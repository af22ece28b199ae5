"""Rotary position embedding on real cos/sin tables, for every family.

A table is `[max_seq_len, rotary_dim]` float32: the cos of each position's angles in the first
half of the last dimension, their sin in the second. The angles are complex numbers in Meta's
reference; here they are real because DTensor, torch.compile and DCP on CPU handle complex
tensors poorly. Position is dimension 0, so context parallel can shard a table the way it
shards the sequence. A family chooses the frequencies (Llama 3.1 scaling, YaRN, none) and the
pairing of features (`apply_rope`'s interleaved pairs, or Qwen's rotate-half).
"""

from __future__ import annotations

import torch


def rope_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """The `dim // 2` unscaled rotation frequencies theta^(-2i/dim) (radians per position),
    float32."""
    exponents = torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


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
