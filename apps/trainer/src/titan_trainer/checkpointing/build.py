"""The run's checkpointer: the plugin `[checkpoint] checkpointer` names, built over the run's
states, with the Hugging Face adapter its import and export need; and the model's and
optimizer's state in the form the checkpoints keep it, which a restarted replica group
receives from a live one."""

from __future__ import annotations

import tempfile
from functools import partial
from typing import Any

from torch import nn

from titan_ckpt import ModelState, OptimizerState
from titan_core import (
    Checkpointer,
    ConfigError,
    ModelSpec,
    ParallelDims,
    Stateful,
    Tokenizer,
    build_hf_adapter,
    dp_coordinates,
    plugins,
    resolve,
)
from titan_data.hf_tokenizer_files import write_hf_tokenizer
from titan_trainer.checkpointing.plan import CheckpointPlan
from titan_trainer.model import hf_model_args


def build_checkpointer(
    config,
    dims: ParallelDims,
    spec: ModelSpec,
    *,
    states: dict[str, Any],
    config_toml: str,
    tokenizer: Tokenizer,
) -> Checkpointer | None:
    """The checkpointer plugin (`checkpoint.checkpointer`) over `states`, or None when the run
    neither saves nor loads (its `CheckpointPlan`)."""
    ckpt = config.checkpoint
    if not CheckpointPlan.of(ckpt).needs_checkpointer:
        return None
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    if ckpt.hf_interval > 0:
        _check_tokenizer_writes(tokenizer)
    # Hugging Face import/export (initial_load_in_hf, last_save_in_hf) needs the weight names;
    # its config.json the model's own context length and the tokenizer's BOS/EOS.
    hf_adapter = (
        build_hf_adapter(
            spec,
            hf_model_args(spec, config, tokenizer.vocab_size),
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
        )
        if spec.hf_adapter
        else None
    )
    return factory(
        ckpt,
        states=states,
        dump_folder=config.job.dump_folder,
        dims=dims,
        config_toml=config_toml,
        dp_rank=dp_coordinates(dims)[0],
        hf_adapter=hf_adapter,
        # Each Hugging Face snapshot (hf_interval) carries the tokenizer, which titan-ckpt
        # does not know: the trainer writes its files.
        hf_extra_files=partial(write_hf_tokenizer, tokenizer),
    )


def _check_tokenizer_writes(tokenizer: Tokenizer) -> None:
    """Hugging Face snapshots carry the tokenizer's files: one that cannot be written as
    such is refused before training, not at the first snapshot."""
    with tempfile.TemporaryDirectory(prefix="titan-hf-tokenizer-") as folder:
        try:
            write_hf_tokenizer(tokenizer, folder)
        except ValueError as e:
            raise ConfigError(
                f"[checkpoint] hf_interval: {e}\nset hf_interval = 0, or use such a tokenizer"
            ) from None


def replica_states(parts: list[nn.Module], optimizer) -> dict[str, Stateful]:
    """The model's and the optimizer's state as the checkpoints keep them (sharded state
    dicts, whatever the layout), for a live replica group to send a restarted one."""
    return {"model": ModelState(parts), "optimizer": OptimizerState(parts, optimizer)}
