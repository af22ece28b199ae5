"""The model a run trains: its family (found once by name, `model_spec`), its arguments (the
flavor's, given the run's vocabulary, sequence length and `[model]` settings by the family's own
`ModelSpec.configure`), the converters (Float8 and friends) applied to it, and the parallelized
parts of this rank. The trainer reads the model only through titan-core's declared contract
(`ModelArgs`, `ModelFeatures`, `TrainableModel`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import nn

from titan_core import (
    ModelArgs,
    ModelSpec,
    ParallelDims,
    get_logger,
    plugins,
    resolve,
    trainable_problems,
)
from titan_trainer.config import JobConfig

log = get_logger("train")


def model_spec(config: JobConfig) -> ModelSpec:
    """The family `[model] name` names, from the plugin registry (PluginError when none): the
    one lookup by name, for what has no `Layout` to ask (the layout holds the run's)."""
    return resolve(plugins.MODELS, config.model.name)


def model_args_for(spec: ModelSpec, config: JobConfig, vocab_size: int) -> ModelArgs:
    """The flavor's arguments for this run (`spec.configure`): the tokenizer's vocabulary
    (rounded up to a multiple of 64, so that any TP degree up to 64 splits it evenly, or the
    vocabulary of the Hugging Face weights the run starts from when that holds the
    tokenizer's: Qwen's 151,936 rows for its 151,669 ids), the training sequence length and
    the `[model]` settings."""
    padded = -(-vocab_size // 64) * 64
    imported = hf_import_vocab(config)
    if imported is not None and imported >= vocab_size:
        padded = imported
    flavor = spec.flavors[config.model.flavor]
    return spec.configure(flavor, config.model, vocab_size=padded, seq_len=config.training.seq_len)


def build_meta_model(spec: ModelSpec, config: JobConfig, vocab_size: int) -> nn.Module:
    """The full model with the run's arguments (`model_args_for`) on the meta device."""
    with torch.device("meta"):
        return spec.build(model_args_for(spec, config, vocab_size))


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


def hf_model_args(spec: ModelSpec, config: JobConfig, vocab_size: int) -> ModelArgs:
    """The model's arguments as a Hugging Face `config.json` states them: the run's (padded)
    vocabulary, and the flavor's own context length as `max_position_embeddings` rather than
    the run's `training.seq_len` (the rotary table's length while training)."""
    args = model_args_for(spec, config, vocab_size)
    own = spec.flavors[config.model.flavor].max_seq_len
    return dataclasses.replace(args, max_seq_len=max(own, args.max_seq_len))


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
        model = build_meta_model(model_spec(config), config, vocab_size)
    lacking = trainable_problems(model)
    if lacking:  # a model that lacks part of the contract is named here, before any memory
        raise TypeError(
            f"{type(model).__name__} cannot be trained: {'; '.join(lacking)} (see"
            " titan_core.TrainableModel)"
        )
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
