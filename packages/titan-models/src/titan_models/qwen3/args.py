"""The shape of a Qwen3 model (dense or mixture-of-experts), and its named flavors.

Qwen3 is a Llama-style decoder with three differences that matter here: every query and key
head is RMS-normalised before the rotary embedding (QK-norm), the head size is given rather
than dim / heads, and the small models tie the embedding and the output projection. The MoE
models route each token to 8 of 128 experts (softmax scores, the chosen ones renormalised).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_models.moe import MoEArgs


@dataclass(frozen=True)
class Qwen3Args:
    dim: int = 4096
    """Width of the residual stream (hidden_size)."""
    n_layers: int = 36
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads."""
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Size of each head (not dim / n_heads in Qwen3)."""
    hidden_dim: int = 12288
    """Hidden size of the dense SwiGLU feed-forward (intermediate_size)."""
    vocab_size: int = 151936
    """Rows of the embedding table; the trainer replaces it with its tokenizer's."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding frequencies."""
    max_seq_len: int = 40960
    """Rows of the rotary table; the trainer sets it to training.seq_len."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    moe: MoEArgs | None = None
    """Mixture-of-experts feed-forward in every block (the MoE flavors); None: dense."""
    depth_init: bool = True
    """Scale the residual-writing projections by each block's depth (else by n_layers)."""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"Qwen3Args: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Args: head_dim {self.head_dim} must be even")
        if self.moe is not None and (problems := self.moe.problems(self.dim)):
            raise ValueError("Qwen3Args.moe: " + "; ".join(problems))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


def _moe(num_experts: int, top_k: int, hidden: int) -> MoEArgs:
    # Qwen3-MoE: softmax over the experts, top-k renormalised (norm_topk_prob), no shared
    # expert, balanced by an auxiliary loss (coefficient 0.001). No expert bias: Hugging Face's
    # Qwen3-MoE has none, so a trained one could not be exported.
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden,
        score_func="softmax",
        route_norm=True,
        load_balance_coeff=None,
        aux_loss_alpha=1e-3,
        aux_loss_type="batch",
    )


_DEBUG = dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048,
              max_seq_len=2048)  # fmt: skip

qwen3_flavors: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(**_DEBUG, hidden_dim=768, tie_word_embeddings=True),
    # The reference's coefficient (0.001) lets this small model collapse onto one expert per
    # layer within 10 steps at the debug config's lr 3e-3; 0.3 keeps every layer under 1.4
    # max/mean by step 50 (trainer README, "Mixture of experts").
    "debugmodel_moe": Qwen3Args(
        **_DEBUG, hidden_dim=768, moe=dataclasses.replace(_moe(8, 2, 192), aux_loss_alpha=0.3)
    ),
    "0.6B": Qwen3Args(
        dim=1024, n_layers=28, n_heads=16, head_dim=128, hidden_dim=3072, tie_word_embeddings=True
    ),  # fmt: skip
    "1.7B": Qwen3Args(
        dim=2048, n_layers=28, n_heads=16, head_dim=128, hidden_dim=6144, tie_word_embeddings=True
    ),  # fmt: skip
    "4B": Qwen3Args(
        dim=2560, n_layers=36, n_heads=32, head_dim=128, hidden_dim=9728, tie_word_embeddings=True
    ),  # fmt: skip
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, head_dim=128, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, head_dim=128, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, head_dim=128, hidden_dim=25600),
    "30B-A3B": Qwen3Args(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        moe=_moe(128, 8, 768),
    ),  # fmt: skip
    "235B-A22B": Qwen3Args(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=12288,
        moe=_moe(128, 8, 1536),
    ),  # fmt: skip
}


def with_moe(args: Qwen3Args, **changes) -> Qwen3Args:
    """`args` with fields of its MoEArgs changed (e.g. use_grouped_mm=False)."""
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **changes))
