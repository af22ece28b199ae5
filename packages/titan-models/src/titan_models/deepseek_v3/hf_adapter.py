"""Converts DeepSeek-V3 state dicts between our names and Hugging Face's `DeepseekV3ForCausalLM`
checkpoints (the Hub's file layout: one set of weights per expert).

Only renames, transposes, stacking (experts) and one split: Hugging Face's
`kv_a_proj_with_mqa` is our `wkv_a` (the latent) above `wk_rope` (the rotary key). No head
permutation: both models rotate
interleaved pairs of the rotary part (Hugging Face's `rope_interleave`, on by default), so the
same weights give the same attention logits. Our stacked expert weights are stored (in, out)
for grouped matmul: `experts.w1[e]` is `experts.{e}.gate_proj.weight` transposed, `w3`
`up_proj`, `w2` `down_proj`. The expert bias is `mlp.gate.e_score_correction_bias`.

Hugging Face's DeepseekV3 routes with sigmoid scores only: the softmax-routed flavors (16B,
236B: DeepSeek-V2 shapes) cannot be written in its format and `hf_config` says so. DeepSeek's
released checkpoints carry the multi-token-prediction module as layer `n_layers`;
`from_hf` leaves it out (this model has none). Tensors must be full (unsharded) and in a
floating-point dtype (dequantise FP8 checkpoints first); a partial state dict (one pipeline
stage's) converts.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_KV_A = ("attention.wkv_a.weight", "attention.wk_rope.weight")
_HF_KV_A = "self_attn.kv_a_proj_with_mqa.weight"
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


class DeepSeekV3HFAdapter:
    """Satisfies `titan_core.protocols.HFAdapter` for `DeepSeekV3Args` models."""

    def __init__(
        self,
        args: DeepSeekV3Args,
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
        self._check_representable()
        out: dict[str, torch.Tensor] = {}
        kv_a: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state_dict.items():
            if name in _ROOT_NAMES:
                if name == "output.weight" and self.args.tie_word_embeddings:
                    continue  # Hugging Face's tied checkpoints carry only embed_tokens
                out[_ROOT_NAMES[name]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"DeepSeekV3HFAdapter.to_hf: no Hugging Face name for {name!r}")
            layer, suffix = match.groups()
            prefix = f"model.layers.{layer}."
            if suffix in _LAYER_NAMES:
                out[prefix + _LAYER_NAMES[suffix]] = tensor
            elif suffix in _KV_A:
                kv_a.setdefault(layer, {})[suffix] = tensor
            elif suffix in _EXPERTS:
                for e, w in enumerate(tensor.unbind(0)):
                    out[f"{prefix}mlp.experts.{e}.{_EXPERTS[suffix]}.weight"] = w.t().contiguous()
            else:
                raise KeyError(f"DeepSeekV3HFAdapter.to_hf: no Hugging Face name for {name!r}")
        for layer, parts in kv_a.items():
            if parts.keys() != set(_KV_A):
                raise KeyError(
                    f"DeepSeekV3HFAdapter.to_hf: layer {layer} needs both {' and '.join(_KV_A)}"
                )
            joined = torch.cat([parts[n] for n in _KV_A], dim=0)
            out[f"model.layers.{layer}.{_HF_KV_A}"] = joined
        if self.args.tie_word_embeddings and "output.weight" in state_dict:
            out.setdefault("model.embed_tokens.weight", state_dict["output.weight"])
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        extra_layers: dict[int, list[str]] = defaultdict(list)
        for name, tensor in hf_state_dict.items():
            if name in self._from_hf_root:
                out[self._from_hf_root[name]] = tensor
                continue
            match = _HF_LAYER.fullmatch(name)
            if match is None:
                raise KeyError(f"DeepSeekV3HFAdapter.from_hf: no Titan name for {name!r}")
            layer, hf_suffix = match.groups()
            if int(layer) >= self.args.n_layers:
                extra_layers[int(layer)].append(hf_suffix)
            elif hf_suffix in self._from_hf_layer:
                out[f"layers.{layer}.{self._from_hf_layer[hf_suffix]}"] = tensor
            elif hf_suffix == _HF_KV_A:
                latent, rope = tensor.split([self.args.kv_lora_rank, self.args.qk_rope_head_dim])
                out[f"layers.{layer}.{_KV_A[0]}"] = latent.contiguous()
                out[f"layers.{layer}.{_KV_A[1]}"] = rope.contiguous()
            elif expert := _HF_EXPERT.fullmatch(hf_suffix):
                index, proj = expert.groups()
                experts[(layer, self._from_hf_expert[proj])][int(index)] = tensor
            else:
                raise KeyError(f"DeepSeekV3HFAdapter.from_hf: no Titan name for {name!r}")
        for layer, suffixes in extra_layers.items():
            if "eh_proj.weight" not in suffixes:  # not a multi-token-prediction module
                raise KeyError(
                    f"DeepSeekV3HFAdapter.from_hf: the checkpoint has layer {layer}, but the model"
                    f" has {self.args.n_layers} (choose the flavor the checkpoint was saved from)"
                )
        n = self.args.moe.num_experts if self.args.moe else 0
        for (layer, suffix), by_index in experts.items():
            if sorted(by_index) != list(range(n)):
                raise KeyError(
                    f"DeepSeekV3HFAdapter.from_hf: layer {layer} has experts {sorted(by_index)[:5]}..."
                    f" of {suffix}, not all {n}"
                )
            out[f"layers.{layer}.{suffix}"] = torch.stack([by_index[e].t() for e in range(n)])
        if self.args.tie_word_embeddings:
            shared = out.get("tok_embeddings.weight", out.get("output.weight"))
            if shared is not None:
                out["tok_embeddings.weight"] = out["output.weight"] = shared
        return out

    def _check_representable(self) -> None:
        moe = self.args.moe
        if moe is not None and moe.score_func != "sigmoid":
            raise ValueError(
                f"DeepSeekV3HFAdapter: this model routes with {moe.score_func} scores, and Hugging"
                " Face's DeepseekV3 only with sigmoid ones (its 16B and 236B flavors have"
                " DeepSeek-V2's softmax routing); export a sigmoid-routed flavor (debugmodel, 671B)"
            )

    def hf_config(self) -> dict[str, Any]:
        self._check_representable()
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
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
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
            "num_nextn_predict_layers": 0,
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
