"""The shape of a Llama 3 model, and the named flavors from debug size to 405B."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs, head_problems


@dataclass(frozen=True)
class LlamaArgs(DecoderArgs):
    """Llama 3's shape: its own fields after the shared ones (`DecoderArgs`, whose defaults are
    Llama 3.1 8B's); head_dim = dim // n_heads."""

    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_heads."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward hidden size (8/3 * dim) before rounding; None means 1."""
    use_rope_scaling: bool = True
    """Apply Llama 3.1's long-context frequency scaling to the rotary embedding."""
    rope_scaling_factor: float = 8.0
    """Divisor applied to the low frequencies (Llama 3.1: 8, Llama 3.2: 32)."""
    rope_low_freq_factor: float = 1.0
    """Wavelengths above original_max_seq_len / this are fully scaled."""
    rope_high_freq_factor: float = 4.0
    """Wavelengths below original_max_seq_len / this are left alone."""
    rope_original_max_seq_len: int = 8192
    """Context length the model was pretrained at before the long-context extension."""

    def problems(self) -> list[str]:
        out = head_problems(self.dim, self.n_heads, self.kv_heads)
        if self.moe is not None:  # every Llama 3 block is dense: experts would be ignored
            out.append("moe: Llama 3 has no mixture-of-experts blocks (Qwen3 and Llama 4 have)")
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, computed the way Meta's reference does (2/3 of 4*dim, scaled, rounded up)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# What the Llama 3.2 shapes share: 8 kv heads, tied embeddings, rope scaling by 32.
_LLAMA_3_2 = dict(n_kv_heads=8, multiple_of=256, tie_word_embeddings=True, rope_scaling_factor=32.0)

llama3_flavors: dict[str, LlamaArgs] = {
    # Small enough for CPU tests; GQA (2 query heads per kv head) and rope scaling both exercised.
    "debugmodel": LlamaArgs(**DEBUG_SIZE, n_heads=16, n_kv_heads=8),
    # About 104M non-embedding parameters, for throughput benchmarks.
    "100M": LlamaArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim_multiplier=1.5, max_seq_len=8192
    ),
    # Llama 3.2 shapes.
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, **_LLAMA_3_2),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, ffn_dim_multiplier=1.0, **_LLAMA_3_2),
    # Llama 3.1 shapes.
    "8B": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": LlamaArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096
    ),
}
"""Named shapes. The official ones use the Llama 3 vocabulary (128256) and max_seq_len 131072."""
