"""The shape of a Llama 4 text model, and its named flavors (Scout, Maverick, debug).

Llama 4 is a Llama 3-style decoder with:
- a mixture of experts in every `interleave_moe_layer_step`-th block (all of them in Scout,
  every second in Maverick, whose other blocks have a dense SwiGLU of `hidden_dim`): top-1 of
  the routed experts by sigmoid score, the score multiplied into the expert's input, plus one
  shared expert;
- interleaved attention ("iRoPE"): every `nope_layer_interval`-th block attends globally
  without rotary embedding, its queries scaled up with position (attention temperature
  tuning, arXiv:2501.19399); the others use the rotary embedding and attend only within
  chunks of `attention_chunk_size` tokens, optionally with a parameter-free L2 norm of every
  query and key head (QK-norm, Scout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs, head_problems
from titan_models.moe import DEBUG_BALANCING, HF_BALANCING, MoEArgs


@dataclass(frozen=True)
class Llama4Args(DecoderArgs):
    """Llama 4's shape: its own fields after the shared ones (`DecoderArgs`); head_dim =
    dim // n_heads."""

    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    hidden_dim: int = 16384
    """Hidden size of the dense blocks' SwiGLU (intermediate_size_mlp)."""
    moe: MoEArgs | None = None
    """The mixture of experts of every `interleave_moe_layer_step`-th block; None: all dense."""
    interleave_moe_layer_step: int = 1
    """Blocks step-1, 2*step-1, ... have experts (1: every block)."""
    use_rope_scaling: bool = False
    """Apply Llama 3.1-style frequency scaling (Scout: factor 16 over 8192 positions)."""
    rope_scaling_factor: float = 16.0
    """Divisor applied to the low frequencies."""
    rope_low_freq_factor: float = 1.0
    """Wavelengths above rope_original_max_seq_len / this are fully scaled."""
    rope_high_freq_factor: float = 1.0
    """Wavelengths below rope_original_max_seq_len / this are left alone."""
    rope_original_max_seq_len: int = 8192
    """Context length before the long-context extension."""
    nope_layer_interval: int = 4
    """Every this-many-th block (4, 8, ...) is global attention without rotary embedding; 0:
    every block uses the rotary embedding and chunked attention."""
    attention_chunk_size: int = 8192
    """Rotary blocks attend only to earlier tokens of the same chunk of this many positions."""
    use_qk_norm: bool = True
    """L2-normalise each query and key head (no weight, epsilon norm_eps) after the rotary
    embedding, in the rotary blocks."""
    attn_temperature_tuning: bool = True
    """Scale the queries of the global blocks by 1 + attn_scale * log(1 + floor((pos + 1) /
    floor_scale))."""
    floor_scale: int = 8192
    """Positions per step of the temperature tuning."""
    attn_scale: float = 0.1
    """Strength of the temperature tuning."""
    # The shared fields' defaults: Scout's and Maverick's.
    dim: int = 5120
    n_layers: int = 48
    n_heads: int = 40
    vocab_size: int = 202048
    max_seq_len: int = 1048576

    def problems(self) -> list[str]:
        out = head_problems(self.dim, self.n_heads, self.n_kv_heads)
        if self.interleave_moe_layer_step < 1:
            out.append(
                f"interleave_moe_layer_step {self.interleave_moe_layer_step} must be 1 or more"
            )
        if self.nope_layer_interval < 0 or self.attention_chunk_size < 1 or self.floor_scale < 1:
            out.append(
                "nope_layer_interval must be 0 or more, attention_chunk_size and floor_scale 1 or more"
            )
        return out + (self.moe.problems(self.dim) if self.moe is not None else [])

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and (layer_id + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer_id: int) -> bool:
        """Rotary embedding and chunked attention (else global attention without position)."""
        return self.nope_layer_interval == 0 or (layer_id + 1) % self.nope_layer_interval != 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))


def _moe(num_experts: int, hidden: int) -> MoEArgs:
    # Llama 4: the best expert by sigmoid score (its score multiplied into its input) plus one
    # shared expert, balanced with HF_BALANCING (which says how that differs from the references).
    return MoEArgs(
        num_experts=num_experts,
        top_k=1,
        hidden_dim=hidden,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=False,
        score_before_experts=True,
        **HF_BALANCING,
    )


llama4_flavors: dict[str, Llama4Args] = {
    # Small enough for CPU tests, with every part of the real ones: experts every second block
    # (the others dense), a global block without rotary embedding every fourth, chunked
    # attention and temperature steps within a 128-token sequence, QK-norm, rope scaling.
    "debugmodel": Llama4Args(
        **DEBUG_SIZE,
        n_heads=16,
        hidden_dim=768,
        # The reference's 0.001 lets this small model collapse (a layer's max/mean 8 of 8 at
        # lr 3e-3), 0.3 leaves 6.3; with DEBUG_BALANCING (the expert capacity and router
        # centering) every layer stays at or under 1.25 and the router's own choice near it
        # (trainer README, "Mixture of experts").
        moe=dataclasses.replace(_moe(8, 256), **DEBUG_BALANCING),
        interleave_moe_layer_step=2,
        use_rope_scaling=True,
        rope_original_max_seq_len=256,
        attention_chunk_size=64,
        floor_scale=32,
    ),
    # Llama 4 Scout (17B active, 16 experts): 109B parameters.
    "17bx16e": Llama4Args(
        moe=_moe(16, 8192),
        interleave_moe_layer_step=1,
        use_rope_scaling=True,
        use_qk_norm=True,
        max_seq_len=10485760,
    ),  # fmt: skip
    # Llama 4 Maverick (17B active, 128 experts): 400B parameters.
    "17bx128e": Llama4Args(
        moe=_moe(128, 8192),
        interleave_moe_layer_step=2,
        use_rope_scaling=False,
        use_qk_norm=False,
    ),  # fmt: skip
}
"""Named shapes (torchtitan's names: 17bx16e is Scout, 17bx128e Maverick), with the published
vocabulary and attention settings."""
