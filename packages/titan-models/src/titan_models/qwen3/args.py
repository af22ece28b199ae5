"""The shape of a Qwen3 model (dense or mixture-of-experts), and its named flavors.

Qwen3 is a Llama-style decoder with three differences that matter here: every query and key
head is RMS-normalised before the rotary embedding (QK-norm), the head size is given rather
than dim / heads, and the small models tie the embedding and the output projection. The MoE
models route each token to 8 of 128 experts (softmax scores, the chosen ones renormalised).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs, head_problems
from titan_models.moe import DEBUG_BALANCING, HF_BALANCING, MoEArgs


@dataclass(frozen=True)
class Qwen3Args(DecoderArgs):
    """Qwen3's shape: its own fields after the shared ones (`DecoderArgs`)."""

    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 128
    """Size of each head (not dim / n_heads in Qwen3)."""
    hidden_dim: int = 12288
    """Hidden size of the dense SwiGLU feed-forward (intermediate_size)."""
    moe: MoEArgs | None = None
    """Mixture-of-experts feed-forward in every block (the MoE flavors); None: dense."""
    # The shared fields' defaults: Qwen3-8B's.
    n_layers: int = 36
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960

    def problems(self) -> list[str]:
        out = head_problems(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)
        return out + (self.moe.problems(self.dim) if self.moe is not None else [])

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads


def _moe(num_experts: int, top_k: int, hidden: int) -> MoEArgs:
    # Qwen3-MoE: softmax over the experts, top-k renormalised (norm_topk_prob), no shared
    # expert, balanced as Hugging Face's Qwen3-MoE is.
    return MoEArgs(
        num_experts, top_k, hidden, score_func="softmax", route_norm=True, **HF_BALANCING
    )


_DEBUG = dict(**DEBUG_SIZE, n_heads=16, head_dim=32, hidden_dim=768)

qwen3_flavors: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(**_DEBUG, tie_word_embeddings=True),
    # The reference's balancing alone (the batch-level auxiliary loss, 0.001) lets this small
    # model collapse onto one expert per layer within 10 steps at the debug config's lr 3e-3;
    # the loss at 0.3 still leaves layers at 3.7 max/mean. With DEBUG_BALANCING (the expert
    # capacity and router centering) every layer stays at or under 1.25 and the router's own
    # choice near it (trainer README, "Mixture of experts").
    "debugmodel_moe": Qwen3Args(
        **_DEBUG, moe=dataclasses.replace(_moe(8, 2, 192), **DEBUG_BALANCING)
    ),
    # Dense: 8 kv heads of 128 (the defaults); the small ones tie their embeddings.
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie_word_embeddings=True),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie_word_embeddings=True),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288),
    "14B": Qwen3Args(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408),
    "32B": Qwen3Args(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600),
    # Mixture of experts: 4 kv heads, 8 of 128 experts per token.
    "30B-A3B": Qwen3Args(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe=_moe(128, 8, 768)
    ),
    "235B-A22B": Qwen3Args(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288, moe=_moe(128, 8, 1536)
    ),
}
