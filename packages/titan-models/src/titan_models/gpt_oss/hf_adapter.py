"""Converts GPT-OSS state dicts between our names and Hugging Face's `GptOssForCausalLM`
checkpoints, through `titan_models.hf_adapter`, which documents the conversion and its limits.

Renames, plus one rearrangement: Hugging Face stacks each layer's experts as ours are, (experts,
in, out), but keeps the gate and up projections in one tensor with their columns interleaved
(`gate_up_proj[..., 0::2]` is our `w1`, `[..., 1::2]` our `w3`; likewise their biases):
`Interleaved`. Our per-expert down bias is the layer's (`feed_forward.down_bias.weight`), theirs the
experts' (`mlp.experts.down_proj_bias`): a rename. The rotary embedding is rotate-half in both,
so no head permutation. As for Qwen3-MoE, the load-balancing state Hugging Face has no place
for (the expert bias, the router center) exports only while zero.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_core.protocols import HFSlice
from titan_models.hf_adapter import (
    NORM_NAMES,
    DecoderHFAdapter,
    Transform,
    ZeroOnly,
    gqa_config,
)


class Interleaved(Transform):
    """Two of ours, `a` and `b`, as the even and odd positions of theirs along the last
    dimension."""

    def __init__(self, a: str, b: str, theirs: str):
        self.ours, self.theirs = (a, b), theirs

    def to_hf(self, parts, where):
        if parts.keys() != set(self.ours):
            raise KeyError(f"{where} needs both {' and '.join(self.ours)}")
        a, b = (parts[n] for n in self.ours)
        return {self.theirs: torch.stack([a, b], dim=-1).flatten(-2).contiguous()}

    def from_hf(self, parts, where):
        tensor = parts[self.theirs]
        return {n: tensor[..., i::2].contiguous() for i, n in enumerate(self.ours)}

    def _theirs_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], 2 * shape[-1])

    def to_hf_slices(self, name, shape, index, tensor, where):
        # Every column of ours is one column of theirs, two apart: a box of ours covers its
        # columns of theirs one by one.
        offset = self.ours.index(name)
        theirs = self._theirs_shape(shape)
        cols = index[-1]
        return [
            (
                HFSlice(
                    self.theirs, theirs, (*index[:-1], slice(2 * c + offset, 2 * c + offset + 1))
                ),
                tensor[..., c - cols.start : c - cols.start + 1],
            )
            for c in range(cols.start, cols.stop)
        ]

    def from_hf_slice(self, name, shape, index, read, where):
        offset = self.ours.index(name)
        cols = index[-1]
        box = (*index[:-1], slice(2 * cols.start, 2 * cols.stop))
        return read(HFSlice(self.theirs, self._theirs_shape(shape), box))[..., offset::2]


class GptOssHFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `GptOssArgs` models."""

    layer_names = NORM_NAMES | {
        **{f"attention.w{p}.{k}": f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")},
        "attention.sinks.weight": "self_attn.sinks",
        "feed_forward.router.gate.weight": "mlp.router.weight",
        "feed_forward.router.gate.bias": "mlp.router.bias",
        "feed_forward.experts.w2": "mlp.experts.down_proj",
        "feed_forward.down_bias.weight": "mlp.experts.down_proj_bias",
    }  # fmt: skip

    def transforms(self) -> list[Transform]:
        experts = "mlp.experts.gate_up_proj"
        out = [
            Interleaved("feed_forward.experts.w1", "feed_forward.experts.w3", experts),
            Interleaved("feed_forward.experts.b1", "feed_forward.experts.b3", experts + "_bias"),
            ZeroOnly.expert_bias("GPT-OSS"),
        ]
        if self.args.moe.router_centering:
            out.append(ZeroOnly.router_center("GPT-OSS", self.args.dim))
        return out

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        windows = [a.attention_window(i) for i in range(a.n_layers)]
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            **gqa_config(a),
            "intermediate_size": a.moe.hidden_dim,
            "num_local_experts": a.moe.num_experts,
            "num_experts_per_tok": a.moe.top_k,
            "experts_per_token": a.moe.top_k,
            "router_aux_loss_coef": a.moe.aux_loss_alpha,
            "swiglu_limit": a.moe.swiglu_limit,
            "sliding_window": a.sliding_window,
            "layer_types": [
                "full_attention" if w is None else "sliding_attention" for w in windows
            ],
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": a.rope_theta,
                "factor": a.rope_factor,
                "beta_fast": a.beta_fast,
                "beta_slow": a.beta_slow,
                "truncate": False,
                "original_max_position_embeddings": a.original_seq_len,
            },
            "initial_context_length": a.original_seq_len,
        }
