"""Will this job's checkpoint load into this layout? Checked offline, before the job starts.

A dry run knows the global shape of every tensor the job's model will hold (it builds the model
at full size on fake tensors); the checkpoint's `.metadata` records the global shape of every
tensor it holds. DCP reshards between any two layouts, so names and global shapes are all that
must agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ckpt import layout
from titan_ckpt.config import Checkpoint
from titan_ckpt.dcp_io import checkpoint_keys


def checkpoint_folder(config: Checkpoint, dump_folder: str) -> Path:
    """Where checkpoints of a run with this config and dump folder live."""
    return Path(
        config.folder if os.path.isabs(config.folder) else os.path.join(dump_folder, config.folder)
    )


def check_loadable(
    config: Checkpoint, dump_folder: str, expected: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], str]:
    """(problems, note): whether the checkpoint a run would resume from holds every tensor of
    `expected` (model state names -> global shapes) with that shape."""
    folder = checkpoint_folder(config, dump_folder)
    found = layout.list_checkpoints(folder)
    if not found:
        if config.initial_load_path:
            path = Path(config.initial_load_path)
            if config.initial_load_in_hf:
                return (
                    [],
                    f"checkpoint: starts from the Hugging Face weights in {path} (not checked offline)",
                )
            if not layout.is_complete(path):
                return [
                    f"[checkpoint] initial_load_path = {str(path)!r} is not a complete checkpoint folder\n"
                    "point it at a step-<N> folder holding titan_commit.json and .metadata"
                ], ""
            return _compare(path, expected), f"checkpoint: starts from {path}"
        return [], f"checkpoint: none in {folder} yet; the run starts from its initialisation"
    resumable = [(s, p) for s, p in found if not layout.read_commit(p).get("model_only")]
    step, path = resumable[-1] if resumable else found[-1]
    problems = _compare(path, expected)
    verdict = "loads into this layout" if not problems else "does NOT load into this layout"
    return problems, f"checkpoint: would resume from {path} (step {step}), which {verdict}"


def _compare(path: Path, expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    try:
        held = checkpoint_keys(path)
    except Exception as e:  # an unreadable metadata file is the finding
        return [f"checkpoint {path} cannot be read: {e}"]
    missing, wrong = [], []
    for name, shape in expected.items():
        meta = held.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            missing.append(name)
        elif tuple(meta.size) != tuple(shape):
            wrong.append(
                f"{name} {tuple(meta.size)} in the checkpoint, {tuple(shape)} in this model"
            )
    problems = []
    if missing:
        problems.append(
            f"checkpoint {path} lacks {len(missing)} tensor(s) of this model: {', '.join(missing[:4])}"
            + (" ..." if len(missing) > 4 else "")
            + "\nis it from another model or flavor? set checkpoint.folder to a fresh folder, or the matching flavor"
        )
    if wrong:
        problems.append(
            f"checkpoint {path} has other shapes than this model: {'; '.join(wrong[:3])}"
            + (" ..." if len(wrong) > 3 else "")
            + "\nthe flavor or vocabulary differs; use the flavor and tokenizer the checkpoint was trained with"
        )
    return problems
