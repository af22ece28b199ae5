"""Hugging Face snapshots on a schedule (`[checkpoint] hf_interval`): their folder and commit.

Snapshots live beside the DCP checkpoints, in `<checkpoint folder>/hf/`:

    hf/step-<N>/
        config.json, model.safetensors (or model-0000i-of-0000n.safetensors + index),
        tokenizer files (tokenizer.json, tokenizer_config.json, ...),
        titan_state/            with `hf_save_optimizer`: a DCP checkpoint of everything
                                but the weights (its own titan_commit.json)
        titan_snapshot.json     the snapshot's marker, written last

A snapshot is written into `hf/step-<N>.tmp/`; when every rank has written its part, rank 0
writes the marker and renames the folder to `hf/step-<N>`. A folder is a snapshot only if it
is named `step-<N>` and holds the marker, so a crash at any moment never leaves a half
snapshot that looks complete; leftovers (`step-<N>.tmp`) are removed after the next snapshot.
On an object store there is no rename: the snapshot is written in place and the marker (one
object, written last) commits it.

`hf/step-<N>` is a Hugging Face model folder as it is (`from_pretrained` and
`AutoTokenizer.from_pretrained` read it; they ignore the rest).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from titan_ckpt import layout
from titan_ckpt.integrity import write_synced
from titan_ckpt.storage import RemotePath, as_path

SNAPSHOTS = "hf"
"""The subfolder of the checkpoint folder that holds the snapshots."""
MARKER = "titan_snapshot.json"
"""Written last: a `step-<N>` folder without it is not a snapshot."""
TITAN_STATE = "titan_state"
"""The DCP checkpoint of the training state beside the weights (`hf_save_optimizer`)."""
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|old)(-\d+)?$")


def snapshots_dir(folder: str | Path) -> Path:
    return as_path(folder) / SNAPSHOTS


def snapshot_dir(folder: str | Path, step: int) -> Path:
    return snapshots_dir(folder) / f"step-{step}"


def tmp_dir(folder: str | Path, step: int) -> Path:
    """Where a snapshot is written: `hf/step-<N>.tmp`, renamed when complete (on an object
    store, the snapshot's own folder, which its marker commits)."""
    final = snapshot_dir(folder, step)
    return final if isinstance(final, RemotePath) else final.with_name(f"step-{step}.tmp")


def is_snapshot(path: str | Path) -> bool:
    try:
        return (as_path(path) / MARKER).is_file()
    except OSError:
        return False


def list_snapshots(folder: str | Path) -> list[tuple[int, Path]]:
    """The complete snapshots in `<folder>/hf`, oldest first."""
    root = snapshots_dir(folder)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP.match(entry.name)
        if match and is_snapshot(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _files(path: Path) -> dict[str, int]:
    if isinstance(path, RemotePath):
        return {}
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


def commit(tmp: Path, final: Path, record: dict[str, Any]) -> None:
    """Make a fully written snapshot `tmp` the snapshot `final` (one process): the marker
    records `record` and every file's size, then the rename."""
    marker = {**record, "files": _files(tmp), "committed_at": time.time()}
    write_synced(tmp / MARKER, json.dumps(marker, indent=1) + "\n")
    if isinstance(tmp, RemotePath):
        return
    layout.rename_into_place(tmp, final)


def discard(path: str | Path) -> None:
    """Delete a snapshot or an unfinished one (its marker first on an object store)."""
    layout.discard(path, marker=MARKER)


def prune(folder: str | Path, keep: int, newest: int) -> list[Path]:
    """Delete complete snapshots beyond the newest `keep` (0 keeps all) among those up to step
    `newest` (later ones, of a run that went further before, are replaced when reached), and
    the remains of unfinished ones."""
    removed = []
    root = snapshots_dir(folder)
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP.match(entry.name)
            unfinished = isinstance(entry, RemotePath) and match and not is_snapshot(entry)
            if _LEFTOVER.match(entry.name) or unfinished:
                discard(entry)
    if keep <= 0:
        return removed
    found = [(step, path) for step, path in list_snapshots(folder) if step <= newest]
    for _, path in found[:-keep]:
        discard(path)
        removed.append(path)
    return removed
