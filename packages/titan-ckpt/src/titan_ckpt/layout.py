"""The checkpoint folder: `step-<N>/` per complete save, and how a save becomes visible.

A save is written into `step-<N>.tmp/`. Only when every rank has finished writing does rank 0
add `config.toml` and the commit marker, flush them, and rename the folder to `step-<N>`. A
folder is a checkpoint only if its name is `step-<N>` and it holds the marker, so a crash, a kill
or a full disk at any moment leaves the previous checkpoint the newest complete one. Leftovers
(`*.tmp`, `*.old`) are ignored and removed after the next successful save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

COMMIT_FILE = "titan_commit.json"
CONFIG_FILE = "config.toml"
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|old)(-\d+)?$")


def step_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def tmp_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step}.tmp"


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return (path / COMMIT_FILE).is_file() and (path / ".metadata").is_file()


def read_commit(path: str | Path) -> dict[str, Any]:
    """The marker's record: step, states saved, world and data-parallel sizes, time."""
    return json.loads((Path(path) / COMMIT_FILE).read_text())


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `folder`, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, record: dict[str, Any], config_toml: str = "") -> None:
    """Make a fully written `tmp` folder the checkpoint `final` (call on one process only)."""
    if config_toml:
        _write_synced(tmp / CONFIG_FILE, config_toml)
    _write_synced(tmp / COMMIT_FILE, json.dumps({**record, "committed_at": time.time()}, indent=1))
    _sync_dir(tmp)
    if final.exists():  # saving a step again (e.g. a seed checkpoint re-created): swap it out
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _sync_dir(final.parent)


def prune(folder: str | Path, keep: int, protect: set[Path] = frozenset()) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0 keeps all), never one in `protect`."""
    if keep <= 0:
        return []
    removed = []
    for _, path in list_checkpoints(folder)[:-keep]:
        if path.resolve() in {p.resolve() for p in protect}:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_leftovers(folder: str | Path, skip: set[Path] = frozenset()) -> list[Path]:
    """Delete the remains of interrupted saves, except those in `skip` (a save in flight)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    skip_names = {p.name for p in skip}
    removed = []
    for entry in folder.iterdir():
        if entry.name in skip_names:
            continue
        incomplete_step = _STEP.match(entry.name) and not is_complete(entry)
        if _LEFTOVER.match(entry.name) or incomplete_step:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
