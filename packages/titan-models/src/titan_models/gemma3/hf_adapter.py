"""Converts Gemma 3 state dicts between our names and Hugging Face's `Gemma3ForCausalLM`
checkpoints (the text decoder: google/gemma-3-1b-*'s layout, `model_type` gemma3_text),
through `titan_models.hf_adapter`, which documents the conversion and its limits.

Only renames: Gemma's rotary embedding and ours share the rotate-half convention (no head
permutation), and both store the norms' w of the (1 + w) scale. The embedding is tied, so a
checkpoint carries `model.embed_tokens` only. The multimodal checkpoints (4B, 12B, 27B on the
Hub, `Gemma3ForConditionalGeneration`) keep the same text weights under
`language_model.model.*`; load them with transformers' `Gemma3ForCausalLM` first, or strip
that prefix.
"""

from __future__ import annotations

from typing import Any

from titan_models.hf_adapter import DecoderHFAdapter, attention_names, gqa_config, swiglu_names


class Gemma3HFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `Gemma3Args` models."""

    layer_names = attention_names() | swiglu_names("feed_forward", "mlp") | {
        "attention_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }  # fmt: skip

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        global_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_scaling_factor != 1.0:
            global_rope = {"rope_type": "linear", "factor": a.rope_scaling_factor,
                           "rope_theta": a.rope_theta}  # fmt: skip
        layer_types = [
            "full_attention" if a.is_global(i) else "sliding_attention" for i in range(a.n_layers)
        ]
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "intermediate_size": a.hidden_dim,
            **gqa_config(a),
            "query_pre_attn_scalar": a.query_pre_attn_scalar,
            "sliding_window": a.sliding_window,
            "layer_types": layer_types,
            "rope_parameters": {
                "full_attention": global_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": a.rope_local_theta},
            },
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }

    def hf_config(self) -> dict[str, Any]:
        config = super().hf_config()
        del config["hidden_act"]  # Gemma's key, and its GeGLU's activation:
        return config | {"hidden_activation": "gelu_pytorch_tanh"}
