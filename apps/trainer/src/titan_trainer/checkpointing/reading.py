"""The checkpoints a command outside training reads (`titan-generate`): the newest usable DCP
checkpoint of a folder, its model weights whole, and a Hugging Face folder's weights."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from titan_ckpt import checkpoint_problems, import_hf, list_checkpoints, load_consolidated


class UnusableCheckpoint(Exception):
    """The checkpoint named, or every one in a folder, fails its checks; the message says which
    and what to do."""


def find_checkpoint(path: Path) -> Path | None:
    """A complete DCP checkpoint whose files pass their checks (every byte against its
    checksum, as `titan-ckpt verify`): `path` itself, or the newest usable one in it or in its
    checkpoint/ (a dump folder), each damaged newer one said on stderr and passed over; None
    when there is none. UnusableCheckpoint when the one named, or every one, is damaged."""
    if (path / ".metadata").is_file():
        problems = checkpoint_problems(path)
        if problems:
            raise UnusableCheckpoint(
                f"{path} is damaged: {'; '.join(problems)}\nname another checkpoint (`titan-ckpt"
                f" list {path.parent}`), or the run's folder for its newest usable one"
            )
        return path
    for folder in (path, path / "checkpoint"):
        found = list_checkpoints(folder) if folder.is_dir() else []
        damaged = []
        for _, step in reversed(found):
            problems = checkpoint_problems(step)
            if not problems:
                for name, why in damaged:
                    _say(f"titan-generate: {name} is damaged ({why}); using {step.name}")
                return step
            damaged.append((step.name, "; ".join(problems)))
        if damaged:
            raise UnusableCheckpoint(
                f"every checkpoint in {folder} is damaged:\n  "
                + "\n  ".join(f"{name}: {why}" for name, why in damaged)
                + f"\n`titan-ckpt verify {folder}` checks them again; generate from another run,"
                " or from a Hugging Face export"
            )
    return None


def _say(text: str) -> None:
    """A note on stderr, from the first rank only under torchrun."""
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr)


def model_weights(step: Path) -> dict:
    """The whole model's weights of the DCP checkpoint `step`, by our names."""
    return load_consolidated(step, "model.", progress=False)


def hf_weights(folder: Path, adapter) -> dict:
    """The weights of the Hugging Face folder `folder`, converted by `adapter` to our names."""
    return import_hf(folder, adapter, progress=False)
