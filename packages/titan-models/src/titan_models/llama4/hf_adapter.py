"""Converts Llama 4 text state dicts between our names and Hugging Face's `Llama4ForCausalLM`,
through `titan_models.hf_adapter`, which documents the conversion and its limits.

No head permutation: Hugging Face's Llama 4 rotates interleaved pairs, as Meta's code and ours
do. The experts are stored stacked in both: Hugging Face's `experts.gate_up_proj` (experts x
dim x 2 hidden) is our `experts.w1` and `experts.w3` side by side, its `experts.down_proj` our
`experts.w2`, all (in, out). Hugging Face's Llama 4 has no expert bias: `from_hf` gives a zero
one, and `to_hf` refuses a model whose bias is not zero (its routing could not be written down
in that format; the flavors balance with the auxiliary loss instead).

The multimodal checkpoints (`Llama4ForConditionalGeneration`) hold the same text weights
under `language_model.`: `from_hf` reads those, and refuses the vision tower's names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from titan_core.protocols import HFSlice
from titan_models.hf_adapter import (
    NORM_NAMES,
    DecoderHFAdapter,
    Joined,
    Transform,
    ZeroOnly,
    attention_names,
    gqa_config,
    swiglu_names,
)
from titan_models.llama3.hf_adapter import llama3_rope_scaling


class Llama4HFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `Llama4Args` models."""

    layer_names = {
        **attention_names(),
        **NORM_NAMES,
        **swiglu_names("feed_forward", "feed_forward"),
        **swiglu_names("feed_forward.shared_experts", "feed_forward.shared_expert"),
        "feed_forward.router.gate.weight": "feed_forward.router.weight",
        "feed_forward.experts.w2": "feed_forward.experts.down_proj",
    }

    def transforms(self) -> list[Transform]:
        if self.args.moe is None:
            return []
        w1_w3 = ("feed_forward.experts.w1", "feed_forward.experts.w3")
        gate_up = Joined(w1_w3, "feed_forward.experts.gate_up_proj", dim=-1)
        zeros = [ZeroOnly.expert_bias("Llama 4")]
        if self.args.moe.router_centering:
            zeros.append(ZeroOnly.router_center("Llama 4", self.args.dim))
        return [gate_up, *zeros]

    def check_representable(self) -> None:
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

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = {name.removeprefix("language_model."): t for name, t in hf_state_dict.items()}
        return super().from_hf(text)

    def from_hf_slice(self, name, shape, index, read):
        def read_text(hf: HFSlice) -> torch.Tensor:
            try:
                return read(hf)
            except KeyError:  # a multimodal checkpoint
                return read(dataclasses.replace(hf, name="language_model." + hf.name))

        return super().from_hf_slice(name, shape, index, read_text)

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.use_rope_scaling:
            rope_parameters = llama3_rope_scaling(a) | {"rope_theta": a.rope_theta}
        moe = a.moe
        uses_rope = [int(a.uses_rope(i)) for i in range(a.n_layers)]
        return {
            "architectures": ["Llama4ForCausalLM"],
            "model_type": "llama4_text",
            "intermediate_size": moe.hidden_dim if moe else a.hidden_dim,
            "intermediate_size_mlp": a.hidden_dim,
            **gqa_config(a),
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
        }
