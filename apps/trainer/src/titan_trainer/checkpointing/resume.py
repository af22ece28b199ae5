"""What the checkpoint a run resumes from was saved with, against the run: checked before any
process group, so that a changed setting is named as such instead of every healthy
checkpoint being tried, failed and reported as "not usable". Which checkpoint that is, and
what it was saved with, the run's checkpointer says (`resume_point`); a run that starts from
`initial_load_path` instead gets the checkpointer's own check of those weights (for Hugging
Face files, their headers: a damaged file is named before any rank reads it).

Two kinds of setting decide whether a checkpoint loads. The model's (`[model] name`, `flavor`,
`n_mtp_layers`, the tokenizer's vocabulary) fix the shapes of its weights: the checkpointer's
`check_loadable` compares every tensor's name and global shape with this run's model on the
meta device, and the saved `config.toml` says which setting made them differ. The data's
(`[training] seq_len`, the global batch size, `dataset`) fix the global sample order that the
saved data position counts in: a changed one cannot be resumed in that order, but the weights
and the optimizer still load with `exclude_from_loading = ["dataloader"]`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from titan_core import ConfigError, ResumePoint, load_config, plugins, resolve
from titan_trainer.batch import BatchShape
from titan_trainer.checkpointing.plan import CheckpointPlan
from titan_trainer.config import JobConfig

MODEL_KEYS = ("model.name", "model.flavor", "model.n_mtp_layers")
"""Settings that change the shapes or names of the model's weights."""
DATA_KEYS = ("training.seq_len", "training.dataset")
"""Settings that fix the global sample order a saved data position counts in, with the global
batch size (compared as the number of samples it comes to: -1 is local x data-parallel)."""


def resume_point(config) -> ResumePoint | None:
    """The checkpoint whose state this run would load (a full one: model-only saves do not
    resume a run), as its checkpointer finds it (`CheckpointerFactory.resume_point`), or
    None when the run loads none."""
    ckpt = config.checkpoint
    if not CheckpointPlan.of(ckpt).loads:
        return None
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    return factory.resume_point(ckpt, config.job.dump_folder)


def saved_config(point: ResumePoint) -> Any | None:
    """The config a checkpoint was saved with (its `config.toml`), or None when it has none or
    it does not load here (written by another version: the load itself reports what does not
    fit)."""
    if point.config_toml is None:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="titan-config-") as tmp:
            # A file on this disk for the config loader (the checkpoint may be at a URL).
            local = Path(tmp) / "config.toml"
            local.write_text(point.config_toml)
            return load_config(JobConfig, [], toml_path=local)
    except (ConfigError, OSError):
        return None


def resume_problems(config, layout, *, shapes: bool = True) -> list[str]:
    """Whether the checkpoint this run resumes from fits it: its weights' shapes (through the
    checkpointer's `check_loadable`; not with `shapes` off, for a dry run, which compares
    every rank role's shapes itself) and the settings its data position was saved with. Each
    problem names the setting that differs, its value there and here, and the fixes."""
    ckpt = config.checkpoint
    if not CheckpointPlan.of(ckpt).loads:
        return []
    point = resume_point(config)
    if point is None:  # nothing to resume: the weights a run starts from, when it names some
        return _loadable(config, layout) if shapes and ckpt.initial_load_path else []
    saved = saved_config(point)
    problems = []
    if shapes and "model" not in ckpt.exclude_from_loading:
        problems += _model_problems(config, layout, point.path, saved)
    if saved is not None and "dataloader" not in ckpt.exclude_from_loading:
        problems += _data_problems(config, layout, point, saved)
    return problems


def loadable_problems(config, expected: dict[str, tuple[int, ...]], notes: list[str]) -> list[str]:
    """Whether the checkpoint a run that saves would resume from holds every tensor of
    `expected` (names and global shapes: the dry run's, of every rank role), through the
    checkpointer's `check_loadable`; its note joins `notes`."""
    ckpt = config.checkpoint
    if not CheckpointPlan.of(ckpt).saves:
        return []
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    problems, note = factory.check_loadable(ckpt, config.job.dump_folder, expected)
    notes.append(note)
    return problems


def _loadable(config, layout) -> list[str]:
    """The checkpointer's `check_loadable` against this run's model on the meta device: every
    tensor's name and global shape, or what it checks of the Hugging Face files of
    `initial_load_in_hf` (their headers)."""
    factory = resolve(plugins.CHECKPOINTERS, config.checkpoint.checkpointer)
    model = layout.meta_model()
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    problems, _ = factory.check_loadable(config.checkpoint, config.job.dump_folder, expected)
    return problems


def _model_problems(config, layout, path, saved) -> list[str]:
    found = _loadable(config, layout)
    if not found:
        return []
    changed = _changed(saved, config, MODEL_KEYS) if saved is not None else []
    if not changed:  # the tokenizer's vocabulary, or a checkpoint of another tool
        return found
    return [
        f"the checkpoint this run resumes from ({path}) was saved with {_listed(changed)}, so"
        f" its weights have other shapes than this run's model ({_shape_detail(found)})\nkeep"
        " the checkpoints (nothing is wrong with them) and resume with the saved value"
        f" ({_flags(changed)}), or start this model in a folder of its own (--job.dump_folder"
        " NEW, or --checkpoint.folder NEW)"
    ]


def _data_problems(config, layout, point: ResumePoint, saved) -> list[str]:
    changed = _changed(saved, config, DATA_KEYS)
    saved_dp, path = point.dp_world_size, point.path
    dp = layout.dims.dp_degree
    flags = _flags(changed)
    if saved_dp is not None:
        before = BatchShape.of(saved.training, saved_dp).global_size
        now = layout.batch.global_size
        if before != now:
            changed.append(("training.global_batch_size", before, now))
            flags = " ".join(x for x in (flags, _batch_flags(before, config.training, dp)) if x)
    if not changed:
        return []
    fix = f"resume with the saved value ({flags}); or " if flags else ""
    return [
        f"the checkpoint this run resumes from ({path}) was saved with {_listed(changed)},"
        f" which {'fix' if len(changed) > 1 else 'fixes'} the order of the samples its data"
        f" position counts in\nkeep the checkpoints (nothing is wrong with them) and {fix}keep"
        " the weights and the optimizer and start the data afresh"
        " (--checkpoint.exclude_from_loading dataloader); or start a new run in another folder"
        " (--job.dump_folder NEW)"
    ]


def _batch_flags(samples: int, training, dp: int) -> str:
    """The flags that take `samples` a step on `dp` data-parallel ranks: the global batch
    size, and a local one that divides it over the ranks when this run's does not; empty
    when the ranks cannot share it evenly."""
    if samples % dp:
        return ""
    per_rank = samples // dp
    local = max(
        d for d in range(1, per_rank + 1) if per_rank % d == 0 and d <= training.local_batch_size
    )
    flags = f"--training.global_batch_size {samples}"
    return flags + (
        f" --training.local_batch_size {local}" if local != training.local_batch_size else ""
    )


def _changed(saved, config, keys) -> list[tuple[str, Any, Any]]:
    out = []
    for key in keys:
        section, name = key.split(".")
        before = getattr(getattr(saved, section), name)
        now = getattr(getattr(config, section), name)
        if before != now:
            out.append((key, before, now))
    return out


def _listed(changed) -> str:
    return "; ".join(
        f"[{key.split('.')[0]}] {key.split('.')[1]} = {before!r} (this run: {now!r})"
        for key, before, now in changed
    )


def _flags(changed) -> str:
    return " ".join(f"--{key} {before}" for key, before, _ in changed)


def _shape_detail(problems: list[str]) -> str:
    """The first line of the checkpointer's finding, without its own advice."""
    return problems[0].splitlines()[0]
