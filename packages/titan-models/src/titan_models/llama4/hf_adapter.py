"""Converts Llama 4 text state dicts between our names and Hugging Face's `Llama4ForCausalLM`.

No head permutation: Hugging Face's Llama 4 rotates interleaved pairs, as Meta's code and ours
do. The experts are stored stacked in both: Hugging Face's `experts.gate_up_proj` (experts x
dim x 2 hidden) is our `experts.w1` and `experts.w3` side by side, its `experts.down_proj` our
`experts.w2`, all (in, out). Hugging Face's Llama 4 has no expert bias: `from_hf` gives a zero
one, and `to_hf` refuses a model whose bias is not zero (its routing could not be written down
in that format; the flavors balance with the auxiliary loss instead).

The multimodal checkpoints (`Llama4ForConditionalGeneration`) hold the same text weights
under `language_model.`: `from_hf` reads those, and refuses the vision tower's names. Tensors
must be full (unsharded); a partial state dict (one pipeline stage's) converts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titan_models.llama4.args import Llama4Args

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "feed_forward.router.gate.weight": "feed_forward.router.weight",
    "feed_forward.experts.w2": "feed_forward.experts.down_proj",
    "feed_forward.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
}
_GATE_UP = "feed_forward.experts.gate_up_proj"
_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class Llama4HFAdapter:
    """Satisfies `titan_core.protocols.HFAdapter` for `Llama4Args` models."""

    def __init__(
        self,
        args: Llama4Args,
        *,
        torch_dtype: str = "bfloat16",
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ):
        self.args = args
        self.torch_dtype = torch_dtype
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._from_hf_layer = {hf: ours for ours, hf in _LAYER_NAMES.items()}
        self._from_hf_root = {hf: ours for ours, hf in _ROOT_NAMES.items()}

    def _check_representable(self) -> None:
        moe = self.args.moe
        if moe is None:
            return
        expected = dict(score_func="sigmoid", score_before_experts=True, num_shared_experts=1,
                        route_norm=False, route_scale=1.0, num_groups=1)  # fmt: skip
        differs = [
            f"{k} = {getattr(moe, k)!r}" for k, v in expected.items() if getattr(moe, k) != v
        ]
        if differs:
            raise ValueError(
                f"Llama4HFAdapter: Hugging Face's Llama 4 routes by sigmoid score into the expert's"
                f" input with one shared expert, and this model's MoEArgs have {', '.join(differs)}"
            )

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._check_representable()
        out: dict[str, torch.Tensor] = {}
        gate_up: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state_dict.items():
            if name in _ROOT_NAMES:
                if name == "output.weight" and self.args.tie_word_embeddings:
                    continue  # Hugging Face's tied checkpoints carry only embed_tokens
                out[_ROOT_NAMES[name]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"Llama4HFAdapter.to_hf: no Hugging Face name for {name!r}")
            layer, suffix = match.groups()
            prefix = f"model.layers.{layer}."
            if suffix in _LAYER_NAMES:
                out[prefix + _LAYER_NAMES[suffix]] = tensor
            elif suffix in ("feed_forward.experts.w1", "feed_forward.experts.w3"):
                gate_up.setdefault(layer, {})[suffix[-2:]] = tensor
            elif suffix == "feed_forward.expert_bias":
                if torch.count_nonzero(tensor):
                    raise ValueError(
                        f"Llama4HFAdapter.to_hf: layer {layer} has a non-zero expert bias, which"
                        " Hugging Face's Llama 4 cannot hold (its routing would change); train with"
                        " a flavor whose load_balance_coeff is None (the Llama 4 flavors' default)"
                    )
            else:
                raise KeyError(f"Llama4HFAdapter.to_hf: no Hugging Face name for {name!r}")
        for layer, parts in gate_up.items():
            if parts.keys() != {"w1", "w3"}:
                raise KeyError(f"Llama4HFAdapter.to_hf: layer {layer} needs both experts.w1 and w3")
            out[f"model.layers.{layer}.{_GATE_UP}"] = torch.cat([parts["w1"], parts["w3"]], dim=-1)
        if self.args.tie_word_embeddings and "output.weight" in state_dict:
            out.setdefault("model.embed_tokens.weight", state_dict["output.weight"])
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in hf_state_dict.items():
            name = name.removeprefix("language_model.")
            if name in self._from_hf_root:
                out[self._from_hf_root[name]] = tensor
                continue
            match = _HF_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"Llama4HFAdapter.from_hf: no Titan name for {name!r}")
            layer, hf_suffix = match.groups()
            prefix = f"layers.{layer}."
            if hf_suffix in self._from_hf_layer:
                out[prefix + self._from_hf_layer[hf_suffix]] = tensor
            elif hf_suffix == _GATE_UP:
                w1, w3 = tensor.chunk(2, dim=-1)
                out[prefix + "feed_forward.experts.w1"] = w1.contiguous()
                out[prefix + "feed_forward.experts.w3"] = w3.contiguous()
                n = tensor.shape[0]
                out.setdefault(prefix + "feed_forward.expert_bias", torch.zeros(n))
            else:
                raise KeyError(f"Llama4HFAdapter.from_hf: no Titan name for {name!r}")
        if self.args.tie_word_embeddings:
            shared = out.get("tok_embeddings.weight", out.get("output.weight"))
            if shared is not None:
                out["tok_embeddings.weight"] = out["output.weight"] = shared
        return out

    def hf_config(self) -> dict[str, Any]:
        self._check_representable()
        a = self.args
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.use_rope_scaling:
            rope_parameters = {
                "rope_type": "llama3",
                "rope_theta": a.rope_theta,
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
            }
        moe = a.moe
        uses_rope = [int(a.uses_rope(i)) for i in range(a.n_layers)]
        return {
            "architectures": ["Llama4ForCausalLM"],
            "model_type": "llama4_text",
            "hidden_size": a.dim,
            "intermediate_size": moe.hidden_dim if moe else a.hidden_dim,
            "intermediate_size_mlp": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "num_local_experts": moe.num_experts if moe else 1,
            "num_experts_per_tok": moe.top_k if moe else 1,
            "moe_layers": [i for i in range(a.n_layers) if a.is_moe_layer(i)],
            "interleave_moe_layer_step": a.interleave_moe_layer_step,
            "router_aux_loss_coef": moe.aux_loss_alpha if moe else 0.0,
            "no_rope_layers": uses_rope,  # 1: rotary embedding, 0: global without
            # Only its default list is built from it (and 0 would divide by zero there).
            "no_rope_layer_interval": a.nope_layer_interval or a.n_layers + 1,
            "layer_types": ["chunked_attention" if r else "full_attention" for r in uses_rope],
            "attention_chunk_size": a.attention_chunk_size,
            "use_qk_norm": a.use_qk_norm,
            "attn_temperature_tuning": a.attn_temperature_tuning,
            "floor_scale": a.floor_scale,
            "attn_scale": a.attn_scale,
            "rope_parameters": rope_parameters,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "attention_bias": False,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
