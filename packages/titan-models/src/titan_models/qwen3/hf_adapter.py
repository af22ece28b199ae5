"""Converts Qwen3 state dicts between our names and Hugging Face's `Qwen3ForCausalLM` /
`Qwen3MoeForCausalLM` checkpoints (the Hub's file layout: one set of weights per expert),
through `titan_models.hf_adapter`, which documents the conversion and its limits.

Only renames, transposes and (for experts) stacking: Qwen's rotary embedding and ours share the
rotate-half convention, so no head permutation. Our expert weights are stacked and stored
(in, out) for grouped matmul: `experts.w1[e]` is `experts.{e}.gate_proj.weight` transposed,
`w3` `up_proj`, `w2` `down_proj`. Hugging Face's Qwen3-MoE has no expert bias: `from_hf` gives
a zero one, and `to_hf` refuses a model whose bias is not zero (its routing could not be
written down in that format; train Qwen3-MoE with the auxiliary loss instead, the flavors'
default). A layer's experts must be all present or all absent.
"""

from __future__ import annotations

from typing import Any

from titan_models.hf_adapter import (
    NORM_NAMES,
    DecoderHFAdapter,
    PerExpert,
    Transform,
    ZeroOnly,
    attention_names,
    gqa_config,
    swiglu_names,
)


class Qwen3HFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `Qwen3Args` models."""

    layer_names = attention_names() | NORM_NAMES | swiglu_names("feed_forward", "mlp") | {
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "feed_forward.router.gate.weight": "mlp.gate.weight",
    }  # fmt: skip

    def transforms(self) -> list[Transform]:
        moe = self.args.moe
        if moe is None:
            return []
        zeros = [ZeroOnly.expert_bias("Qwen3-MoE")]
        if moe.router_centering:
            zeros.append(ZeroOnly.router_center("Qwen3-MoE", self.args.dim))
        return [*PerExpert.experts(moe.num_experts), *zeros]

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": a.hidden_dim,
            **gqa_config(a),
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
        }
        if a.moe is not None:
            config |= {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "moe_intermediate_size": a.moe.hidden_dim,
                "num_experts": a.moe.num_experts,
                "num_experts_per_tok": a.moe.top_k,
                "norm_topk_prob": a.moe.route_norm,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "router_aux_loss_coef": a.moe.aux_loss_alpha,
            }
        return config
