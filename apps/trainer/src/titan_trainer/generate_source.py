"""What `titan-generate` generates from: a DCP checkpoint (the model, flavor, sequence length
and tokenizer of the run's config saved beside it; weights through
`titan_trainer.checkpointing`) or a Hugging Face folder (the flavor whose shapes match its
`config.json`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from titan_core import load_config, plugins, resolve
from titan_trainer.checkpointing.reading import find_checkpoint, hf_weights, model_weights
from titan_trainer.config import JobConfig
from titan_trainer.model import model_args_for, model_spec


class GenerateError(Exception):
    pass


STRUCTURE = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "rope_theta",
    "tie_word_embeddings",
)
"""The keys of a Hugging Face config.json that pick the flavor."""


@dataclasses.dataclass
class Source:
    """What to build and load: the model family and its arguments, the weights' reader, the
    tokenizer's name or path and the data plugin that builds it."""

    spec: Any
    args: Any
    read_weights: Any
    tokenizer: str
    data_plugin: str
    where: str


def dcp_source(step: Path, tokenizer: str | None) -> Source:
    saved = step / "config.toml"
    if not saved.is_file():
        raise GenerateError(
            f"{step} has no config.toml (the run's config, which names the model and its "
            "tokenizer); convert it to a Hugging Face folder with titan-ckpt and pass that"
        )
    config = load_config(JobConfig, ["--job.config_file", str(saved)])
    spec = model_spec(config)
    data = resolve(plugins.DATA, config.training.data_plugin)
    name = tokenizer or config.model.tokenizer_source()[0]
    vocab = data.build_tokenizer(name).vocab_size
    return Source(
        spec=spec,
        args=model_args_for(spec, config, vocab),
        read_weights=lambda: model_weights(step),
        tokenizer=name,
        data_plugin=config.training.data_plugin,
        where=str(step),
    )


def hf_source(folder: Path, model: str, flavor: str | None, tokenizer: str | None) -> Source:
    spec = resolve(plugins.MODELS, model)
    hf = json.loads((folder / "config.json").read_text())
    candidates = [flavor] if flavor else list(spec.flavors)
    for name in candidates:
        if name not in spec.flavors:
            raise GenerateError(
                f"{spec.name} has no flavor {name!r}; it has {', '.join(spec.flavors)}"
            )
        args = spec.flavors[name]
        changes = {
            key: hf[hf_key]
            for key, hf_key in (
                ("vocab_size", "vocab_size"),
                ("max_seq_len", "max_position_embeddings"),
            )
            if hf_key in hf  # both `ModelArgs` fields
        }
        args = dataclasses.replace(args, **changes)
        built = spec.hf_adapter(args).hf_config()
        if all(built.get(k) == hf.get(k) for k in STRUCTURE if k in hf):
            break
    else:
        shape = ", ".join(f"{k} {hf.get(k)}" for k in STRUCTURE if k in hf)
        raise GenerateError(
            f"{folder}/config.json ({shape}) matches no flavor of {spec.name}"
            + (f" ({flavor} differs)" if flavor else "")
            + "\nname the model family with --model, or the flavor with --flavor"
        )
    if tokenizer is None:
        tokenizer = str(folder)  # a folder holding tokenizer.model
    return Source(
        spec=spec,
        args=args,
        read_weights=lambda: hf_weights(folder, spec.hf_adapter(args)),
        tokenizer=tokenizer,
        data_plugin="titan",
        where=str(folder),
    )


def find_source(a: argparse.Namespace) -> Source:
    path = Path(a.source)
    if not path.exists():
        raise GenerateError(f"{path} does not exist")
    step = find_checkpoint(path)
    if step is not None:
        return dcp_source(step, a.tokenizer)
    if (path / "config.json").is_file():
        return hf_source(path, a.model, a.flavor, a.tokenizer)
    raise GenerateError(
        f"{path} is neither a DCP checkpoint (a step-N folder, a folder of them, or a run's dump "
        "folder) nor a Hugging Face folder (config.json and safetensors)"
    )
