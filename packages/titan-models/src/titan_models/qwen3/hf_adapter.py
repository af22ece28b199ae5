"""Converts Qwen3 state dicts between our names and Hugging Face's `Qwen3ForCausalLM` /
`Qwen3MoeForCausalLM` checkpoints (the Hub's file layout: one set of weights per expert).

Only renames, transposes and (for experts) stacking: Qwen's rotary embedding and ours share the
rotate-half convention, so no head permutation. Our expert weights are stacked and stored
(in, out) for grouped matmul: `experts.w1[e]` is `experts.{e}.gate_proj.weight` transposed,
`w3` `up_proj`, `w2` `down_proj`. Hugging Face's Qwen3-MoE has no expert bias: `from_hf` gives
a zero one, and `to_hf` refuses a model whose bias is not zero (its routing could not be
written down in that format; train Qwen3-MoE with the auxiliary loss instead, the flavors'
default).

Tensors must be full (unsharded): gather DTensors before converting. A partial state dict (one
pipeline stage's) converts; a layer's experts must be all present or all absent.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from titan_models.qwen3.args import Qwen3Args

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
}
_EXPERTS = {"feed_forward.experts.w1": "gate_proj", "feed_forward.experts.w3": "up_proj",
            "feed_forward.experts.w2": "down_proj"}  # fmt: skip
_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class Qwen3HFAdapter:
    """Satisfies `titan_core.protocols.HFAdapter` for `Qwen3Args` models."""

    def __init__(
        self,
        args: Qwen3Args,
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
        self._from_hf_expert = {hf: ours for ours, hf in _EXPERTS.items()}

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            if name in _ROOT_NAMES:
                if name == "output.weight" and self.args.tie_word_embeddings:
                    continue  # Hugging Face's tied checkpoints carry only embed_tokens
                out[_ROOT_NAMES[name]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"Qwen3HFAdapter.to_hf: no Hugging Face name for {name!r}")
            layer, suffix = match.groups()
            prefix = f"model.layers.{layer}."
            if suffix in _LAYER_NAMES:
                out[prefix + _LAYER_NAMES[suffix]] = tensor
            elif suffix in _EXPERTS:
                for e, w in enumerate(tensor.unbind(0)):
                    out[f"{prefix}mlp.experts.{e}.{_EXPERTS[suffix]}.weight"] = w.t().contiguous()
            elif suffix == "feed_forward.expert_bias":
                if torch.count_nonzero(tensor):
                    raise ValueError(
                        f"Qwen3HFAdapter.to_hf: layer {layer} has a non-zero expert bias, which"
                        " Hugging Face's Qwen3-MoE cannot hold (its routing would change); train"
                        " with a flavor whose load_balance_coeff is None (the Qwen3-MoE flavors' default)"
                    )
            else:
                raise KeyError(f"Qwen3HFAdapter.to_hf: no Hugging Face name for {name!r}")
        if self.args.tie_word_embeddings and "output.weight" in state_dict:
            out.setdefault("model.embed_tokens.weight", state_dict["output.weight"])
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        for name, tensor in hf_state_dict.items():
            if name in self._from_hf_root:
                out[self._from_hf_root[name]] = tensor
                continue
            match = _HF_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"Qwen3HFAdapter.from_hf: no Titan name for {name!r}")
            layer, hf_suffix = match.groups()
            if hf_suffix in self._from_hf_layer:
                out[f"layers.{layer}.{self._from_hf_layer[hf_suffix]}"] = tensor
            elif expert := _HF_EXPERT.fullmatch(hf_suffix):
                index, proj = expert.groups()
                experts[(layer, self._from_hf_expert[proj])][int(index)] = tensor
            else:
                raise KeyError(f"Qwen3HFAdapter.from_hf: no Titan name for {name!r}")
        for (layer, suffix), by_index in experts.items():
            n = self.args.moe.num_experts if self.args.moe else 0
            if sorted(by_index) != list(range(n)):
                raise KeyError(
                    f"Qwen3HFAdapter.from_hf: layer {layer} has experts {sorted(by_index)[:5]}..."
                    f" of {suffix}, not all {n}"
                )
            out[f"layers.{layer}.{suffix}"] = torch.stack([by_index[e].t() for e in range(n)])
            bias = f"layers.{layer}.feed_forward.expert_bias"
            out.setdefault(bias, torch.zeros(n, dtype=torch.float32))
        if self.args.tie_word_embeddings:
            shared = out.get("tok_embeddings.weight", out.get("output.weight"))
            if shared is not None:
                out["tok_embeddings.weight"] = out["output.weight"] = shared
        return out

    def hf_config(self) -> dict[str, Any]:
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "num_hidden_layers": a.n_layers,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
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
