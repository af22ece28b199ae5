"""The model settings a run chooses within a flavor, owned by the families that read them: a
trainer's `[model]` section carries them (`ModelOptions`), and `configure_args` turns a flavor's
arguments into a run's (the `ModelSpec.configure` of titan-models' families). Imports no torch:
a trainer reads and checks its config before torch's seconds of import."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class ModelOptions:
    """The `[model]` keys titan-models' families read. Unset (None) takes the flavor's own."""

    moe_aux_loss_alpha: float | None = None
    """Mixture-of-experts models: weight of the auxiliary balance loss (per sequence or per
    microbatch, as the family's reference); unset: the flavor's own (the trainer README's MoE
    section lists them); 0 turns it off."""
    moe_load_balance_coeff: float | None = None
    """Mixture-of-experts models: how far each expert's selection bias moves towards even load
    after every optimizer step (DeepSeek-V3's auxiliary-loss-free balancing); unset: the
    flavor's own; 0 turns it off."""
    moe_router_selection: Literal["topk", "sinkhorn"] | None = None
    """Mixture-of-experts models: how training ranks each token's experts. `topk`: by score,
    as every family's reference; `sinkhorn`: by the router's logits balanced over each
    sequence's tokens (Megatron-LM's sinkhorn load balancing). The weights stay the router's
    scores; validation, generation and Hugging Face export rank by score. Not with the expert
    bias (set moe_load_balance_coeff = 0). Unset: the flavor's own (every shipped flavor:
    topk)."""
    moe_capacity_factor: float | None = None
    """Mixture-of-experts models: in training, each expert takes at most this times its even
    share of a sequence's token choices, first come, first served along the sequence; the
    rest go to their next-ranked expert with room (re-routed, not dropped; the metric line
    shows their share), so every layer's max/mean load stays at or under it (each sequence
    on its own, whatever the parallel layout; under context parallel each rank's part). A
    loop over the sequence's positions: slow at long sequences. Unset: the flavor's own (the
    MoE debug flavors: 1.25); 0 turns it off."""
    moe_router_centering: bool | None = None
    """Mixture-of-experts models: subtract from the router's input the mean router input of
    the last training step (summed over the data-parallel ranks, saved with the model), in
    training, validation and generation alike, so that a direction every token shares does
    not send them all to the same experts. A Hugging Face router has no place for the
    center: `last_save_in_hf` is refused with it before the run starts. Unset: the flavor's own (the MoE debug flavors: true); false turns it off."""
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention within a packed sample: `causal`, or `block_causal`: a token attends only to
    the earlier tokens of its own document (documents start at the tokenizer's BOS, or for one
    without a BOS at the EOS ending the previous one), so that packed documents do not see each
    other. How the mask is computed: `block_causal_impl`. The model's forward must take
    `document_ids` (titan-models' Llama 3 and Qwen3 do). Not with context parallel."""
    block_causal_impl: Literal["auto", "dense", "flex", "varlen"] = "auto"
    """With attn_mask_type = 'block_causal', how the mask is computed (the result is the
    same): `dense`: SDPA with a [batch, 1, seq, seq] boolean mask (any device, O(seq^2)
    memory); `flex`: FlexAttention with a BlockMask from the document boundaries, compiled
    kernels on CUDA (on the CPU it has no backward, so training refuses it); `varlen`: the
    documents cut out of the flattened batch by their offsets (cu_seqlens), torch's
    variable-length flash attention on CUDA (torch 2.10+; bf16/fp16), SDPA per document
    elsewhere and in float32;
    `auto`: flex on CUDA, dense elsewhere. The model must have a `block_causal_impl`
    attribute (titan-models' do) for any but auto. Checked against the dense mask on the
    job's device before training."""
    attention_backend: Literal["default", "auto", "flash", "cudnn", "efficient", "math"] = "default"
    """Which SDPA kernel runs causal attention (attn_mask_type = 'causal'). `default`: torch's
    own dispatch (its fixed priority: on CUDA flash, then memory-efficient, then cuDNN);
    `auto`: each kernel that runs this rank's shape (local batch, sequence after context
    parallel, heads after tensor parallel) timed forward and backward on the job's device at
    start-up, the fastest used on every rank and logged with the timings (not timed by the
    dry run); `flash`, `cudnn`, `efficient`, `math`: that kernel, refused before training
    where it cannot run the shape (on a CPU only flash and math exist; context parallel
    needs a fused kernel, not math). Grouped key/value heads are read in place where the
    kernel takes them, else repeated. For models whose attention layers have an
    `sdpa_backend` attribute (titan-models' Llama 3, Qwen3 and Llama 4's global blocks)."""
    n_mtp_layers: int | None = None
    """Multi-token-prediction layers (DeepSeek-V3's MTP modules: D layers after the blocks
    that predict the tokens 2..D+1 positions ahead, trained with `[training]
    mtp_loss_weight`, dropped for inference). Unset: the flavor's (deepseek_v3 debugmodel and
    671B: 1); 0 trains without them. Only for a family that has them (deepseek_v3). Not with
    context parallel."""

    def validate(self) -> list[str]:
        problems = [
            f"[model] {key} = {value} is not valid\nuse 0 (off), a positive weight, or leave it unset for the flavor's"
            for key in ("moe_aux_loss_alpha", "moe_load_balance_coeff")
            if (value := getattr(self, key)) is not None and value < 0
        ]
        factor = self.moe_capacity_factor
        if factor is not None and factor != 0 and not factor >= 1:
            problems.append(
                f"[model] moe_capacity_factor = {factor} is not valid\nuse 0 (no limit), 1 or"
                " more (the experts must have room for every token's choices), or leave it"
                " unset for the flavor's"
            )
        return problems

    def moe_keys_set(self) -> list[str]:
        """The mixture-of-experts keys this run sets (those that change a flavor's experts)."""
        return [key for key in MOE_KEYS if getattr(self, key) is not None]

    def experts(self, moe: Any) -> Any:
        """A flavor's `MoEArgs` with the balancing these options set (0: off)."""
        changes: dict[str, Any] = {}
        if self.moe_aux_loss_alpha is not None:
            changes["aux_loss_alpha"] = self.moe_aux_loss_alpha
        if self.moe_load_balance_coeff is not None:
            changes["load_balance_coeff"] = self.moe_load_balance_coeff or None
        if self.moe_router_selection is not None:
            changes["router_selection"] = self.moe_router_selection
        if self.moe_capacity_factor is not None:
            changes["capacity_factor"] = self.moe_capacity_factor or None
        if self.moe_router_centering is not None:
            changes["router_centering"] = self.moe_router_centering
        return dataclasses.replace(moe, **changes)


MOE_KEYS = (
    "moe_aux_loss_alpha",
    "moe_load_balance_coeff",
    "moe_router_selection",
    "moe_capacity_factor",
    "moe_router_centering",
)
"""The keys of `ModelOptions` that change a flavor's mixture of experts."""


def configure_args(args: Any, options: ModelOptions, *, vocab_size: int, seq_len: int) -> Any:
    """A flavor's `args` (a titan-models family's) for a run: its vocabulary and sequence
    length, the block-causal implementation, the multi-token-prediction depth and the experts'
    balancing that `options` set (unset keys keep the flavor's)."""
    changes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_seq_len": seq_len,
        "block_causal_impl": options.block_causal_impl,
    }
    if args.moe is not None:
        changes["moe"] = options.experts(args.moe)
    if options.n_mtp_layers is not None:
        changes["n_mtp_layers"] = options.n_mtp_layers
    return dataclasses.replace(args, **changes)
