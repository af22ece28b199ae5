"""Converts Llama state dicts between our names and Hugging Face's `LlamaForCausalLM`.

Besides renaming, the query and key projections are permuted: Meta's rotary embedding rotates
interleaved pairs (0, 1), (2, 3), ... of each head, Hugging Face's rotates the halves
(0, d/2), (1, d/2 + 1), .... Reordering the output rows of wq/wk per head makes the two
models compute the same function; `from_hf` applies the exact inverse reordering.

Tensors must be full (unsharded): gather DTensors before converting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from titan_models.llama3.args import LlamaArgs

# Our name -> Hugging Face name; "{}" is the layer index.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_ROOT_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_split_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class LlamaHFAdapter:
    """Satisfies `titan_core.protocols.HFAdapter` for `LlamaArgs` models.

    Partial state dicts (one pipeline stage's) convert key by key; an unknown key raises.
    """

    def __init__(
        self,
        args: LlamaArgs,
        *,
        torch_dtype: str = "bfloat16",
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ):
        self.args = args
        self.torch_dtype = torch_dtype
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._to_hf_layer = _LAYER_NAMES
        self._from_hf_layer = {hf: ours for ours, hf in _LAYER_NAMES.items()}
        self._from_hf_root = {hf: ours for ours, hf in _ROOT_NAMES.items()}

    def _heads(self, suffix: str) -> int | None:
        """How many heads to permute for this per-layer key, or None when it is not q/k."""
        if suffix == "attention.wq.weight":
            return self.args.n_heads
        if suffix == "attention.wk.weight":
            return self.args.kv_heads
        return None

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            if name in _ROOT_NAMES:
                if name == "output.weight" and self.args.tie_word_embeddings:
                    continue  # HF tied checkpoints carry only embed_tokens
                out[_ROOT_NAMES[name]] = tensor
                continue
            match = _OURS_LAYER.fullmatch(name)
            if match is None or match.group(2) not in _LAYER_NAMES:
                raise KeyError(f"LlamaHFAdapter.to_hf: no Hugging Face name for {name!r}")
            layer, suffix = match.groups()
            heads = self._heads(suffix)
            if heads is not None:
                tensor = _interleaved_to_half_split(tensor, heads)
            out[f"model.layers.{layer}.{_LAYER_NAMES[suffix]}"] = tensor
        if self.args.tie_word_embeddings and "output.weight" in state_dict:
            out.setdefault("model.embed_tokens.weight", state_dict["output.weight"])
        return out

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in hf_state_dict.items():
            if name in self._from_hf_root:
                out[self._from_hf_root[name]] = tensor
                continue
            match = _HF_LAYER.fullmatch(name)
            if match is None or match.group(2) not in self._from_hf_layer:
                raise KeyError(f"LlamaHFAdapter.from_hf: no Titan name for {name!r}")
            layer, hf_suffix = match.groups()
            suffix = self._from_hf_layer[hf_suffix]
            heads = self._heads(suffix)
            if heads is not None:
                tensor = _half_split_to_interleaved(tensor, heads)
            out[f"layers.{layer}.{suffix}"] = tensor
        if self.args.tie_word_embeddings:
            # Our module exposes the shared matrix under both names.
            shared = out.get("tok_embeddings.weight", out.get("output.weight"))
            if shared is not None:
                out["tok_embeddings.weight"] = out["output.weight"] = shared
        return out

    def hf_config(self) -> dict[str, Any]:
        a = self.args
        rope_scaling = None
        if a.use_rope_scaling:
            rope_scaling = {
                "rope_type": "llama3",
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
            }
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "num_hidden_layers": a.n_layers,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": rope_scaling,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
