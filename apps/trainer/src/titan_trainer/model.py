"""The model a run trains: its arguments (the flavor's, with the run's vocabulary, sequence
length, mixture-of-experts balancing and multi-token-prediction depth), the converters (Float8
and friends) applied to it, and the parallelized parts of this rank."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from torch import nn

from titan_core import ParallelDims, get_logger, plugins, resolve
from titan_trainer.config import JobConfig

log = get_logger("train")


def model_args_for(spec, config: JobConfig, vocab_size: int):
    """The flavor's arguments with the tokenizer's vocabulary (rounded up to a multiple of 64,
    so that any TP degree up to 64 splits it evenly, or the vocabulary of the Hugging Face
    weights the run starts from when that holds the tokenizer's: Qwen's 151,936 rows for its
    151,669 ids) and the training sequence length."""
    args = spec.flavors[config.model.flavor]
    padded = -(-vocab_size // 64) * 64
    imported = hf_import_vocab(config)
    if imported is not None and imported >= vocab_size:
        padded = imported
    changes = {}
    fields = {f.name for f in dataclasses.fields(args)}
    if "vocab_size" in fields:
        changes["vocab_size"] = padded
    if "max_seq_len" in fields:
        changes["max_seq_len"] = config.training.seq_len
    if getattr(args, "moe", None) is not None:
        changes["moe"] = moe_balance_for(args.moe, config)
    if config.model.n_mtp_layers is not None and "n_mtp_layers" in fields:
        changes["n_mtp_layers"] = config.model.n_mtp_layers
    return dataclasses.replace(args, **changes)


def moe_balance_for(moe, config: JobConfig):
    """The flavor's MoE arguments with the balancing the [model] keys set (0: off)."""
    m = config.model
    changes = {}
    if m.moe_aux_loss_alpha is not None:
        changes["aux_loss_alpha"] = m.moe_aux_loss_alpha
    if m.moe_load_balance_coeff is not None:
        changes["load_balance_coeff"] = m.moe_load_balance_coeff or None
    if m.moe_router_selection is not None:
        changes["router_selection"] = m.moe_router_selection
    if m.moe_capacity_factor is not None:
        changes["capacity_factor"] = m.moe_capacity_factor or None
    if m.moe_router_centering is not None:
        changes["router_centering"] = m.moe_router_centering
    return dataclasses.replace(moe, **changes)


def hf_import_vocab(config: JobConfig) -> int | None:
    """The vocabulary size of the Hugging Face weights a run starts from (`vocab_size` in the
    config.json of `initial_load_path` with `initial_load_in_hf`), or None."""
    ckpt = config.checkpoint
    if not (ckpt.initial_load_in_hf and ckpt.initial_load_path):
        return None
    try:
        with open(os.path.join(ckpt.initial_load_path, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):  # no readable config.json: the tokenizer's
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def hf_model_args(spec, config: JobConfig, vocab_size: int):
    """The model's arguments as a Hugging Face `config.json` states them: the run's (padded)
    vocabulary, and the flavor's own context length as `max_position_embeddings` rather than
    the run's `training.seq_len` (the rotary table's length while training)."""
    args = model_args_for(spec, config, vocab_size)
    own = spec.flavors[config.model.flavor]
    if hasattr(own, "max_seq_len"):
        args = dataclasses.replace(args, max_seq_len=max(own.max_seq_len, args.max_seq_len))
    return args


def build_converters(config: JobConfig, dims: ParallelDims) -> list:
    """The model converters named in `model.converters` (Float8 and friends), each given the
    config section of the same name."""
    return [
        resolve(plugins.CONVERTERS, name)(config_section(config, name), dims)
        for name in config.model.converters
    ]


def build_model(
    config: JobConfig,
    runtime,
    vocab_size: int,
    converters: list,
    stage_io=None,
    *,
    layout=None,
) -> list[nn.Module]:
    """Meta-device model, converters, parallelism (`runtime`: a `ParallelRuntime`); returns
    this rank's parts, still on the meta device (`runtime.materialize`, then weights from
    `runtime.init_weights` or a checkpoint). With `layout` (a `titan_trainer.layout.Layout`)
    the model is the one its checks built and read; it is converted in place, so the layout
    hands it over once."""
    if layout is not None:
        model = layout.take_model(vocab_size)
    else:
        from titan_trainer.layout import build_meta_model

        model = build_meta_model(config, vocab_size)
    # The checks refused a block_causal_impl other than auto for a model without the attribute.
    if config.model.attn_mask_type == "block_causal" and hasattr(model, "block_causal_impl"):
        model.block_causal_impl = config.model.block_causal_impl
    for converter in converters:
        converter.convert(model)
    if config.model.print_after_conversion:
        log.info("model after conversion:\n%s", model)
    return runtime.parallelize(model, stage_io)


def config_section(config: JobConfig, dotted: str):
    """The config section named like a converter (`quantize.linear.float8`), or None."""
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node
