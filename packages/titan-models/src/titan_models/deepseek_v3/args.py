"""The shape of a DeepSeek-V3 model, and its named flavors.

DeepSeek-V3 (arXiv:2412.19437) is a decoder whose attention is multi-head latent attention
(MLA): keys and values are rebuilt per head from one small latent vector per token
(`kv_lora_rank`), queries optionally from another (`q_lora_rank`), and each head's query and
key are the concatenation of a part without position (`qk_nope_head_dim`) and a rotary part
(`qk_rope_head_dim`), the key's rotary part shared by all heads. The rotary frequencies are
stretched by YaRN for long context. The first `n_dense_layers` blocks have a dense SwiGLU,
the others a mixture of experts with shared experts.

The 16B and 236B flavors are DeepSeek-V2-Lite's and DeepSeek-V2's shapes (softmax routing) in
this architecture, as torchtitan has them; 671B is DeepSeek-V3 (sigmoid routing over 8 groups
of 32 experts, auxiliary-loss-free balancing, one multi-token-prediction layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs
from titan_models.moe import DEBUG_BALANCING, MoEArgs


@dataclass(frozen=True)
class DeepSeekV3Args(DecoderArgs):
    """DeepSeek-V3's shape: its own fields after the shared ones (`DecoderArgs`)."""

    n_dense_layers: int = 3
    """The first this many blocks have a dense feed-forward, the others experts
    (first_k_dense_replace)."""
    hidden_dim: int = 18432
    """Hidden size of the dense SwiGLU feed-forward (intermediate_size)."""
    q_lora_rank: int = 1536
    """Rank of the compressed query (wq_a -> q_norm -> wq_b); 0: one projection wq."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent each token caches."""
    qk_nope_head_dim: int = 128
    """Per-head query/key size without position."""
    qk_rope_head_dim: int = 64
    """Per-head query/key size with the rotary embedding (the key's is shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value size."""
    rope_factor: float = 40.0
    """YaRN: how much longer than `original_seq_len` the context is made; 1 turns YaRN off."""
    original_seq_len: int = 4096
    """YaRN: the context length of pretraining before the extension."""
    beta_fast: int = 32
    """YaRN: dimensions rotating more than this often over the original context are kept."""
    beta_slow: int = 1
    """YaRN: dimensions rotating less than this often are fully interpolated."""
    mscale: float = 1.0
    """YaRN: the softmax scale is multiplied by (0.1 * mscale * ln(rope_factor) + 1) ** 2."""
    moe: MoEArgs | None = None
    """The mixture of experts of the blocks after the first `n_dense_layers`; None: every block
    dense."""
    # The shared fields' defaults: DeepSeek-V3's.
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    vocab_size: int = 129280
    norm_eps: float = 1e-6
    """Epsilon of the block and final RMSNorms (the latent norms use 1e-6, as DeepSeek's)."""
    rope_theta: float = 10000.0
    max_seq_len: int = 163840

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.n_dense_layers <= self.n_layers:
            out.append(f"n_dense_layers {self.n_dense_layers} must be 0 .. n_layers")
        if self.qk_rope_head_dim % 2:
            out.append(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.rope_factor < 1:
            out.append(f"rope_factor {self.rope_factor} must be 1 (no YaRN) or more")
        if self.n_mtp_layers < 0:
            out.append(f"n_mtp_layers {self.n_mtp_layers} must be 0 (none) or more")
        return out + (self.moe.problems(self.dim) if self.moe is not None else [])

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return 0 if self.moe is None else self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.n_dense_layers


def _v2_moe(
    num_experts: int, hidden: int, route_scale: float, groups: int = 1, top_groups: int = 1
):
    # DeepSeek-V2(-Lite): softmax over the experts, top 6, not renormalised, 2 shared experts;
    # balanced by an auxiliary loss (V2's expert-level factor 0.003): a bias barely moves a
    # peaked softmax (see MoEArgs.load_balance_coeff).
    return MoEArgs(
        num_experts=num_experts,
        top_k=6,
        hidden_dim=hidden,
        num_shared_experts=2,
        score_func="softmax",
        route_norm=False,
        route_scale=route_scale,
        num_groups=groups,
        top_k_groups=top_groups,
        load_balance_coeff=None,
        aux_loss_alpha=3e-3,
    )


def _v3_moe(
    num_experts: int,
    top_k: int,
    hidden: int,
    groups: int,
    top_groups: int,
    route_scale: float = 2.5,
) -> MoEArgs:
    # DeepSeek-V3: sigmoid scores, top-k renormalised and scaled by 2.5, one shared expert,
    # group-limited routing; the auxiliary-loss-free bias (update speed 0.001) plus a very
    # small sequence-wise auxiliary loss (alpha 0.0001), as in the paper.
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden,
        num_shared_experts=1,
        score_func="sigmoid",
        route_norm=True,
        route_scale=route_scale,
        num_groups=groups,
        top_k_groups=top_groups,
        load_balance_coeff=1e-3,
        aux_loss_alpha=1e-4,
    )


_V2_ATTENTION = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     rope_factor=40.0, original_seq_len=4096, mscale=0.707, max_seq_len=163840)  # fmt: skip

# The debug flavors' shape: one dense block first, latent attention at CPU-test size.
_DEBUG_MLA = dict(**DEBUG_SIZE, n_dense_layers=1, hidden_dim=768, q_lora_rank=128, kv_lora_rank=64,
                  qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)  # fmt: skip

deepseek_v3_flavors: dict[str, DeepSeekV3Args] = {
    # Small enough for CPU tests, with every part of the 671B model: compressed queries, YaRN,
    # a dense block then experts in 4 groups of 2, two groups per token, a shared expert, and
    # a multi-token-prediction layer.
    "debugmodel": DeepSeekV3Args(
        **_DEBUG_MLA,
        n_heads=8,
        # The reference's bias step (0.001) moves a bias by 0.05 in a 50-step run, too little
        # against this small model's collapse at lr 3e-3 (0.03 with an auxiliary loss of 0.3
        # still leaves 4.0); with DEBUG_BALANCING (the expert capacity and router centering)
        # on top of the reference's balancing every layer stays at or under 1.25 and the
        # router's own choice near it (trainer README, "Mixture of experts").
        moe=dataclasses.replace(_v3_moe(8, 2, 192, groups=4, top_groups=2), **DEBUG_BALANCING),
        n_mtp_layers=1,
    ),
    # DeepSeek-V2-Lite's shape: 15.7B parameters, 2.4B active.
    "16B": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        vocab_size=102400,
        hidden_dim=10944,
        q_lora_rank=0,
        moe=_v2_moe(64, 1408, route_scale=1.0),
        **_V2_ATTENTION,
    ),  # fmt: skip
    # DeepSeek-V2's shape: 236B parameters, 21B active.
    "236B": DeepSeekV3Args(
        dim=5120,
        n_layers=60,
        n_dense_layers=1,
        n_heads=128,
        vocab_size=102400,
        hidden_dim=12288,
        q_lora_rank=1536,
        moe=_v2_moe(160, 1536, route_scale=16.0, groups=8, top_groups=3),
        **_V2_ATTENTION,
    ),  # fmt: skip
    # DeepSeek-V3: 671B parameters in the main model, 37B active, and one multi-token-
    # prediction layer (11.7B here: the embedding and output projection it shares are not
    # counted again, as the 14B DeepSeek publishes counts its checkpoint's copies of them).
    "671B": DeepSeekV3Args(moe=_v3_moe(256, 8, 2048, groups=8, top_groups=4), n_mtp_layers=1),
    # Kimi K2 (Moonshot AI, arXiv:2507.20534) at CPU-test size: its differences from the
    # DeepSeek-V3 debug flavor kept (one expert group, no multi-token prediction, a dense
    # first block, half the heads, YaRN with beta_fast 1, rope_theta 50000).
    "kimi_k2_debug": DeepSeekV3Args(
        **_DEBUG_MLA,
        n_heads=4,
        rope_theta=50000.0,
        rope_factor=32.0,
        beta_fast=1,
        moe=dataclasses.replace(
            _v3_moe(8, 2, 192, groups=1, top_groups=1, route_scale=2.827), **DEBUG_BALANCING
        ),
    ),
    # Kimi K2: DeepSeek-V3's architecture with 384 experts (top 8, one expert group), 64
    # heads, a 160K vocabulary, YaRN 32x over 4096 and no MTP layer: 1.04T parameters, 32.6B
    # active.
    "kimi_k2_1T": DeepSeekV3Args(
        n_dense_layers=1,
        n_heads=64,
        vocab_size=163840,
        rope_theta=50000.0,
        rope_factor=32.0,
        beta_fast=1,
        max_seq_len=131072,
        moe=_v3_moe(384, 8, 2048, groups=1, top_groups=1, route_scale=2.827),
    ),
}
"""Named shapes; the official ones with their published vocabulary and YaRN settings."""
