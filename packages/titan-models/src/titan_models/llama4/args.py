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

from titan_models.moe import MoEArgs


@dataclass(frozen=True)
class Llama4Args:
    dim: int = 5120
    """Width of the residual stream (hidden_size)."""
    n_layers: int = 48
    """Number of transformer blocks."""
    n_heads: int = 40
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = 202048
    """Rows of the embedding table; the trainer replaces it with its tokenizer's."""
    hidden_dim: int = 16384
    """Hidden size of the dense blocks' SwiGLU (intermediate_size_mlp)."""
    moe: MoEArgs | None = None
    """The mixture of experts of every `interleave_moe_layer_step`-th block; None: all dense."""
    interleave_moe_layer_step: int = 1
    """Blocks step-1, 2*step-1, ... have experts (1: every block)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm and of the QK-norm."""
    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""
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
    max_seq_len: int = 1048576
    """Rows of the rotary and temperature tables; the trainer sets it to training.seq_len."""
    nope_layer_interval: int = 4
    """Every this-many-th block (4, 8, ...) is global attention without rotary embedding; 0:
    every block uses the rotary embedding and chunked attention."""
    attention_chunk_size: int = 8192
    """Rotary blocks attend only to earlier tokens of the same chunk of this many positions."""
    use_qk_norm: bool = True
    """L2-normalise each query and key head (no weight) after the rotary embedding, in the
    rotary blocks."""
    attn_temperature_tuning: bool = True
    """Scale the queries of the global blocks by 1 + attn_scale * log(1 + floor((pos + 1) /
    floor_scale))."""
    floor_scale: int = 8192
    """Positions per step of the temperature tuning."""
    attn_scale: float = 0.1
    """Strength of the temperature tuning."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    depth_init: bool = True
    """Scale the residual-writing projections by each block's depth (else by n_layers)."""

    def __post_init__(self) -> None:
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        elif self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.interleave_moe_layer_step < 1:
            problems.append(
                f"interleave_moe_layer_step {self.interleave_moe_layer_step} must be 1 or more"
            )
        if self.nope_layer_interval < 0 or self.attention_chunk_size < 1 or self.floor_scale < 1:
            problems.append(
                "nope_layer_interval must be 0 or more, attention_chunk_size and floor_scale 1 or more"
            )
        if self.moe is not None:
            problems += self.moe.problems(self.dim)
        if problems:
            raise ValueError("Llama4Args: " + "; ".join(problems))

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
    # shared expert. Balanced by the batch-level auxiliary loss at the coefficient of Hugging
    # Face's config (router_aux_loss_coef, 0.001; Hugging Face's model itself computes no
    # balance loss), not by torchtitan's expert bias (0.001), which Hugging Face's Llama 4
    # cannot hold (so a trained model exports).
    return MoEArgs(
        num_experts=num_experts,
        top_k=1,
        hidden_dim=hidden,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=False,
        score_before_experts=True,
        load_balance_coeff=None,
        aux_loss_alpha=1e-3,
        aux_loss_type="batch",
    )


llama4_flavors: dict[str, Llama4Args] = {
    # Small enough for CPU tests, with every part of the real ones: experts every second block
    # (the others dense), a global block without rotary embedding every fourth, chunked
    # attention and temperature steps within a 128-token sequence, QK-norm, rope scaling.
    "debugmodel": Llama4Args(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        hidden_dim=768,
        # The reference's 0.001 lets this small model collapse (a layer's max/mean 7 of 8 at
        # lr 3e-3); 0.3 halves it (trainer README, "Mixture of experts").
        moe=dataclasses.replace(_moe(8, 256), aux_loss_alpha=0.3),
        interleave_moe_layer_step=2,
        use_rope_scaling=True,
        rope_original_max_seq_len=256,
        max_seq_len=2048,
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


def with_moe(args: Llama4Args, **changes) -> Llama4Args:
    """`args` with fields of its MoEArgs changed (e.g. use_grouped_mm=False)."""
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **changes))
