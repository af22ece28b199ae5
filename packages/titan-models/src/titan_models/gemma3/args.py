"""The shape of a Gemma 3 text decoder, and its named flavors.

Gemma 3 is a grouped-query decoder with these differences from Llama 3 that matter here: the
embedding is multiplied by sqrt(dim); every RMSNorm scales by (1 + w) (w stored, starting at 0)
in float32; each block has four norms (before and after attention, before and after the
feed-forward); the feed-forward is GeGLU (gelu, tanh approximation); queries and keys are
RMS-normalised per head (QK-norm); the attention scale is query_pre_attn_scalar**-0.5 rather
than head_dim**-0.5; the embedding and output projection are tied; and five of every six
blocks attend over a sliding window of recent positions, with their own rotary base, while
the sixth attends globally with a base of 1e6 (linearly scaled by 8 in 4B, 12B and 27B).

The flavors are the text decoders of Google's Hub configs (google/gemma-3-1b-pt's
`config.json`; the `text_config` of google/gemma-3-{4b,12b,27b}-pt, whose unset keys take
transformers' `Gemma3TextConfig` defaults, among them vocab_size 262208, rope_local_base_freq
10000, rms_norm_eps 1e-6, sliding_window_pattern 6), checked against transformers'
`Gemma3ForCausalLM` parameter counts in tests/test_gemma3.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs, head_problems


@dataclass(frozen=True)
class Gemma3Args(DecoderArgs):
    """Gemma 3's shape: its own fields after the shared ones (`DecoderArgs`)."""

    n_kv_heads: int = 16
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Size of each head (not dim / n_heads in Gemma 3)."""
    hidden_dim: int = 21504
    """Hidden size of the GeGLU feed-forward (intermediate_size)."""
    query_pre_attn_scalar: int = 168
    """Attention scores are scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5)."""
    sliding_window: int = 1024
    """A local block's query at position p sees the keys at p - sliding_window < k <= p."""
    global_every: int = 6
    """Every this many blocks one attends globally (block i when (i + 1) % global_every == 0);
    the others over the sliding window (sliding_window_pattern)."""
    rope_local_theta: float = 10_000.0
    """Rotary base of the local blocks (rope_local_base_freq); `rope_theta` is the global
    blocks'."""
    rope_scaling_factor: float = 8.0
    """Linear rotary scaling of the global blocks (positions divided by it); 1: none."""
    # The shared fields' defaults: Gemma 3 27B's.
    dim: int = 5376
    n_layers: int = 62
    n_heads: int = 32
    vocab_size: int = 262208
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 131072
    tie_word_embeddings: bool = True

    def problems(self) -> list[str]:
        out = head_problems(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)
        if self.sliding_window < 1:
            out.append(f"sliding_window {self.sliding_window} must be at least 1")
        if self.global_every < 1:
            out.append(f"global_every {self.global_every} must be at least 1")
        if self.rope_scaling_factor < 1:
            out.append(f"rope_scaling_factor {self.rope_scaling_factor} must be at least 1")
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_global(self, layer_id: int) -> bool:
        """Whether block `layer_id` attends over every earlier position (else: the window)."""
        return (layer_id + 1) % self.global_every == 0

    def attention_window(self, layer_id: int) -> int | None:
        """Block `layer_id`'s attention window: None (full causal) for a global block, else
        `sliding_window` (Hugging Face's convention: p - W < k <= p)."""
        return None if self.is_global(layer_id) else self.sliding_window


gemma3_flavors: dict[str, Gemma3Args] = {
    # Blocks 0-4 local over 128 positions (half the debug config's sequence), block 5 global.
    "debugmodel": Gemma3Args(
        **DEBUG_SIZE, n_heads=4, n_kv_heads=2, head_dim=64, hidden_dim=1024,
        query_pre_attn_scalar=64, sliding_window=128, rope_scaling_factor=1.0,
    ),
    # google/gemma-3-1b-pt: 262144 tokens, no rotary scaling, a 512-position window.
    "1B": Gemma3Args(
        dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, hidden_dim=6912,
        vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512,
        rope_scaling_factor=1.0, max_seq_len=32768,
    ),
    "4B": Gemma3Args(
        dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, hidden_dim=10240,
        query_pre_attn_scalar=256,
    ),
    "12B": Gemma3Args(
        dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, head_dim=256, hidden_dim=15360,
        query_pre_attn_scalar=256,
    ),
    "27B": Gemma3Args(),
}  # fmt: skip
