"""The shape of a GPT-OSS model, and its named flavors (20B, 120B, debug).

GPT-OSS (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b model card") is a decoder with grouped-query
attention and a mixture of experts in every block, and these differences from Llama 3:
- attention sinks: a learned logit per head in every softmax (`titan_models.local_attention`);
- a sliding window of 128 positions in every other block (blocks 0, 2, 4, ...), full causal
  attention in the others;
- biases on the attention's four projections, on the router and on every expert's projections;
- the router's top-k of its logits, weighted by the softmax over those k;
- experts with a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate), gate clamped above at
  7 and up to +-7 (`MoEArgs.activation`);
- YaRN rotary embedding (factor 32 over 4,096 positions, theta 150,000, the ramp's ends not
  rounded), in the rotate-half pairing, cos and sin scaled by YaRN's attention factor.

The flavors' numbers are the released checkpoints' `config.json` (Hugging Face's
`openai/gpt-oss-20b` and `openai/gpt-oss-120b`), which `transformers`' `GptOssConfig` defaults
to for the 120B one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_models.args import DEBUG_SIZE, DecoderArgs, head_problems
from titan_models.moe import DEBUG_BALANCING, HF_BALANCING, MoEArgs


@dataclass(frozen=True)
class GptOssArgs(DecoderArgs):
    """GPT-OSS's shape: its own fields after the shared ones (`DecoderArgs`)."""

    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 64
    """Size of each head (not dim / n_heads in GPT-OSS)."""
    sliding_window: int = 128
    """The windowed blocks' window: a query sees this many positions, its own included."""
    rope_factor: float = 32.0
    """YaRN's context extension factor (1: none)."""
    original_seq_len: int = 4096
    """YaRN: the context length before the extension."""
    beta_fast: float = 32.0
    """YaRN: dimensions turning more often than this over the original context keep their
    frequency."""
    beta_slow: float = 1.0
    """YaRN: dimensions turning less often than this are fully interpolated."""
    moe: MoEArgs | None = None
    """The mixture of experts of every block."""
    # The shared fields' defaults: GPT-OSS 120B's.
    dim: int = 2880
    n_layers: int = 36
    n_heads: int = 64
    vocab_size: int = 201088
    rope_theta: float = 150000.0
    attention_bias: bool = True
    attention_sinks: bool = True

    def problems(self) -> list[str]:
        out = head_problems(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)
        if self.moe is None:
            out.append("GPT-OSS has experts in every block: give it moe")
        else:
            out += self.moe.problems(self.dim)
        if self.sliding_window < 1:
            out.append(f"sliding_window = {self.sliding_window} must be 1 or more")
        return out

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def attention_window(self, layer_id: int) -> int | None:
        """Blocks 0, 2, 4, ... attend within the sliding window, the others to every earlier
        position (Hugging Face's `layer_types`)."""
        return self.sliding_window if layer_id % 2 == 0 else None


def _moe(num_experts: int, top_k: int, hidden: int) -> MoEArgs:
    # Top-k of the router's logits, weighted by the softmax over those k: a softmax over all
    # experts renormalised over the chosen ones is the same; biases and the clamped SwiGLU.
    return MoEArgs(
        num_experts,
        top_k,
        hidden,
        score_func="softmax",
        route_norm=True,
        router_bias=True,
        expert_biases=True,
        activation="clamped_swiglu",
        **HF_BALANCING,
    )


gpt_oss_flavors: dict[str, GptOssArgs] = {
    # Every part of the real ones at the shared debug size: sinks, windows of 128 in blocks
    # 0, 2, 4, the biases, the clamped SwiGLU and YaRN; balanced as the other MoE debug flavors.
    "debugmodel": GptOssArgs(
        **DEBUG_SIZE,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        moe=dataclasses.replace(_moe(8, 2, 256), **DEBUG_BALANCING),
    ),
    "20B": GptOssArgs(n_layers=24, moe=_moe(32, 4, 2880)),
    "120B": GptOssArgs(n_layers=36, moe=_moe(128, 4, 2880)),
}
"""Named shapes: the released checkpoints' and a debug one."""
