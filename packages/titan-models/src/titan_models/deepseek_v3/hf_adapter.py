"""Converts DeepSeek-V3 state dicts between our names and Hugging Face's `DeepseekV3ForCausalLM`
checkpoints (the Hub's file layout: one set of weights per expert), through
`titan_models.hf_adapter`, which documents the conversion and its limits.

Only renames, transposes, stacking (experts) and one split: Hugging Face's
`kv_a_proj_with_mqa` is our `wkv_a` (the latent) above `wk_rope` (the rotary key). No head
permutation: both models rotate
interleaved pairs of the rotary part (Hugging Face's `rope_interleave`, on by default), so the
same weights give the same attention logits. Our stacked expert weights are stored (in, out)
for grouped matmul: `experts.w1[e]` is `experts.{e}.gate_proj.weight` transposed, `w3`
`up_proj`, `w2` `down_proj`. The expert bias is `mlp.gate.e_score_correction_bias`.

Hugging Face's DeepseekV3 routes with sigmoid scores only: the softmax-routed flavors (16B,
236B: DeepSeek-V2 shapes) cannot be written in its format and `hf_config` says so. DeepSeek's
released checkpoints carry the multi-token-prediction layer as layer `n_layers` (61), which
transformers' model class does not load; ours maps it to our MTP layer (`n_mtp_layers`, see
`titan_models.hf_adapter`), and `from_hf` leaves out the MTP layers a model has no place for
(a flavor with `n_mtp_layers` 0). Tensors must be in a floating-point dtype (dequantise FP8
checkpoints first).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from titan_models.hf_adapter import (
    HF_LAYER,
    NORM_NAMES,
    DecoderHFAdapter,
    Joined,
    PerExpert,
    Transform,
    ZeroOnly,
    swiglu_names,
)


class DeepSeekV3HFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `DeepSeekV3Args` models."""

    layer_names = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.router.gate.weight": "mlp.gate.weight",
        "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
        **NORM_NAMES,
        **swiglu_names("feed_forward", "mlp"),
        **swiglu_names("feed_forward.shared_experts", "mlp.shared_experts"),
    }

    def transforms(self) -> list[Transform]:
        a = self.args
        kv_a = ("attention.wkv_a.weight", "attention.wk_rope.weight")
        sizes = [a.kv_lora_rank, a.qk_rope_head_dim]
        joined = Joined(kv_a, "self_attn.kv_a_proj_with_mqa.weight", dim=0, sizes=sizes)
        if a.moe is None:
            return [joined]
        centered = [ZeroOnly.router_center("DeepSeek-V3", a.dim)] if a.moe.router_centering else []
        return [joined, *PerExpert.experts(a.moe.num_experts), *centered]

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept: dict[str, torch.Tensor] = {}
        beyond: dict[int, list[str]] = defaultdict(list)
        layers = self.args.n_layers + self.args.n_mtp_layers
        for name, tensor in hf_state_dict.items():
            match = HF_LAYER.fullmatch(name)
            if match and int(match.group(1)) >= layers:
                beyond[int(match.group(1))].append(match.group(2))
            else:
                kept[name] = tensor
        for layer, suffixes in beyond.items():
            if "eh_proj.weight" not in suffixes:  # not a multi-token-prediction module
                raise KeyError(
                    f"DeepSeekV3HFAdapter.from_hf: the checkpoint has layer {layer}, but the model"
                    f" has {self.args.n_layers} and {self.args.n_mtp_layers} multi-token-prediction"
                    " (choose the flavor the checkpoint was saved from)"
                )
        return super().from_hf(kept)

    def check_representable(self) -> None:
        moe = self.args.moe
        if moe is not None and moe.score_func != "sigmoid":
            raise ValueError(
                f"DeepSeekV3HFAdapter: this model routes with {moe.score_func} scores, and Hugging"
                " Face's DeepseekV3 only with sigmoid ones (its 16B and 236B flavors have"
                " DeepSeek-V2's softmax routing); export a sigmoid-routed flavor (debugmodel, 671B)"
            )

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_factor > 1:
            rope_parameters = {
                "rope_type": "yarn",
                "rope_theta": a.rope_theta,
                "factor": a.rope_factor,
                "original_max_position_embeddings": a.original_seq_len,
                "beta_fast": a.beta_fast,
                "beta_slow": a.beta_slow,
                # Equal: Hugging Face scales cos/sin by their ratio (1 here) and the softmax by
                # mscale_all_dim's factor squared, as ours does with `mscale`.
                "mscale": a.mscale,
                "mscale_all_dim": a.mscale,
            }
        moe = a.moe
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "intermediate_size": a.hidden_dim,
            "first_k_dense_replace": a.n_dense_layers if moe is not None else a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "rope_interleave": True,
            "rope_parameters": rope_parameters,
            "moe_intermediate_size": moe.hidden_dim if moe else a.hidden_dim,
            "n_routed_experts": moe.num_experts if moe else 1,
            "n_shared_experts": moe.num_shared_experts if moe else 0,
            "num_experts_per_tok": moe.top_k if moe else 1,
            "n_group": moe.num_groups if moe else 1,
            "topk_group": moe.top_k_groups if moe else 1,
            "norm_topk_prob": moe.route_norm if moe else False,
            "routed_scaling_factor": moe.route_scale if moe else 1.0,
            "num_nextn_predict_layers": a.n_mtp_layers,
        }
