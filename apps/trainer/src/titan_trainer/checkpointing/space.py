"""Where a run's checkpoints go, checked before training: the stores they live in answer, their
local folder takes writes, and they fit on its disk."""

from __future__ import annotations

from pathlib import Path

from titan_ckpt.preflight import checkpoint_folder, storage_problems
from titan_core import plugins, resolve
from titan_trainer.checkpointing.plan import CheckpointPlan
from titan_trainer.optimizer import optimizer_state_copies


def store_problems(config) -> list[str]:
    """Whether the remote stores of the run's checkpoints (`folder`, `initial_load_path`)
    answer: asked before anything reads them."""
    return storage_problems(config.checkpoint, config.job.dump_folder)


def folder_to_write(config) -> str | None:
    """The local folder the run writes checkpoints to, for a write test before anything is
    written; None when it writes none, or writes to a URL (s3://...), which the checkpointer
    probes itself when it is built (still before the first step)."""
    if not CheckpointPlan.of(config.checkpoint).writes:
        return None
    folder = checkpoint_folder(config.checkpoint, config.job.dump_folder)
    return str(folder) if isinstance(folder, Path) else None


def space_problems(config, layout, notes: list[str]) -> list[str]:
    """Whether the run's checkpoints fit on the disk of their folder: the checkpointer's
    `check_space`, given the bytes of the state it saves, counted from the shapes of the
    `layout`'s model on the meta device (parameters as built, the optimizer's copies in float32
    units)."""
    ckpt = config.checkpoint
    if not CheckpointPlan.of(ckpt).saves:
        return []
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    params = list(layout.meta_model().parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params) + int(
        sum(p.numel() for p in params) * 4 * optimizer_state_copies(config.optimizer)
    )
    problems, note = factory.check_space(
        ckpt, config.job.dump_folder, state_bytes, config.training.steps
    )
    if note:
        notes.append(note)
    return problems
