"""The checkpoint folder: `step-<N>/` per complete save, and how a save becomes visible.

A save is written into `step-<N>.tmp/`. Only when every rank has finished writing does rank 0
add `config.toml` and the commit marker, flush them, and rename the folder to `step-<N>`. A
folder is a checkpoint only if its name is `step-<N>` and it holds the marker, so a crash, a kill
or a full disk at any moment leaves the previous checkpoint the newest complete one. Leftovers
of unfinished saves (`*.tmp`, `*.old`) are ignored and removed after the next successful save.

A `step-<N>` that holds DCP's `.metadata` (written last) but no marker never comes from an
unfinished save: its marker was deleted, or another tool wrote it. It is reported by name
(`unmarked`), never loaded and never deleted.

The marker records the size and checksum of every file of the checkpoint (see integrity.py), so
a file that was cut short, overwritten or replaced after the commit is found before loading.

On an object store (a URL folder, see storage.py) there is no rename: a save is written in
place into `step-<N>/` and the marker, one object written last, commits it. A `step-<N>/` there
without a marker is an unfinished save whatever it holds: never loaded, and removed after the
next successful save. Deleting a checkpoint removes its marker first, so that a deletion cut
short never leaves a marked folder with files missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from titan_ckpt.integrity import collect_checksums, file_entry, write_synced
from titan_ckpt.storage import RemotePath, as_path

COMMIT_FILE = "titan_commit.json"
CONFIG_FILE = "config.toml"
_STEP = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|old)(-\d+)?$")


def step_dir(folder: str | Path, step: int) -> Path:
    return as_path(folder) / f"step-{step}"


def tmp_dir(folder: str | Path, step: int) -> Path:
    """Where a save is written: `step-<N>.tmp`, renamed at the commit; on an object store the
    checkpoint's own `step-<N>`, which its marker commits."""
    folder = as_path(folder)
    if isinstance(folder, RemotePath):
        return folder / f"step-{step}"
    return folder / f"step-{step}.tmp"


def discard(path: str | Path, marker: str = COMMIT_FILE) -> None:
    """Delete a checkpoint folder or a save's remains (its `marker` first on an object store,
    so that nothing half-deleted still looks complete)."""
    path = as_path(path)
    if isinstance(path, RemotePath):
        (path / marker).unlink(missing_ok=True)
        path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def is_complete(path: str | Path) -> bool:
    path = as_path(path)
    try:
        return (path / COMMIT_FILE).is_file() and (path / ".metadata").is_file()
    except OSError:  # a folder this process may not look into
        return False


def read_commit(path: str | Path) -> dict[str, Any]:
    """The marker's record: step, states saved, world and data-parallel sizes, file checksums,
    time. Raises OSError when it cannot be read and ValueError when it is not a marker."""
    record = json.loads((as_path(path) / COMMIT_FILE).read_text())
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError(f"{COMMIT_FILE} holds no step number; it is not a titan commit marker")
    return record


def step_problem(path: str | Path, record: dict[str, Any]) -> str | None:
    """A marker whose step is not the one its `step-<N>` folder is named for."""
    name = as_path(path).name
    match = _STEP.match(name)
    if match and int(match.group(1)) != record["step"]:
        return (
            f"its commit marker says step {record['step']}, but its folder is {name}: the marker"
            " belongs to another checkpoint (copied or edited), so which step this is cannot be"
            " known; move the folder away"
        )
    return None


def unmarked(folder: str | Path) -> list[tuple[int, Path]]:
    """`step-<N>` folders that look complete (they hold `.metadata`) but have no commit marker,
    oldest first: never loaded, never deleted, reported. None on an object store, where a
    folder without its marker is an unfinished save."""
    folder = as_path(folder)
    if isinstance(folder, RemotePath) or not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir() and not _has_marker(entry) and _has_metadata(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


UNMARKED = (
    "it holds .metadata but no commit marker {marker}: not a checkpoint this package can trust"
    " (the marker was deleted, or another tool wrote it); it is never loaded. If it is one of"
    " this run's, restore its marker from a copy; otherwise move it away"
)


def _has_metadata(path: Path) -> bool:
    try:
        return (path / ".metadata").exists()
    except OSError:
        return True


def committed(folder: str | Path) -> list[tuple[int, Path]]:
    """`step-<N>` folders holding a commit marker, oldest first, whether or not the marker
    can be read and the rest of the checkpoint is there (the load reports what is wrong)."""
    folder = as_path(folder)
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _STEP.match(entry.name)
        if match and entry.is_dir() and _has_marker(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _has_marker(path: Path) -> bool:
    try:
        return (path / COMMIT_FILE).exists()
    except OSError:  # cannot even look: report it when loading rather than skip it silently
        return True


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `folder` (commit marker and `.metadata`), oldest first. Their
    checksums are checked when they are loaded, or by `titan-ckpt verify`."""
    return [(step, path) for step, path in committed(folder) if is_complete(path)]


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, record: dict[str, Any], config_toml: str = "") -> None:
    """Make a fully written `tmp` folder the checkpoint `final` (call on one process only): the
    marker records `record` and the size and checksum of every file. On an object store `tmp`
    is `final`, and writing the marker (last) is the commit."""
    mark(tmp, record, config_toml)
    if isinstance(tmp, RemotePath):
        return
    _sync_dir(tmp)
    rename_into_place(tmp, final)


def rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder `tmp` to `final` (local disk), swapping out a `final` already
    there (the same step saved again: a seed checkpoint re-created, a finished run rerun), and
    make the rename durable."""
    if final.exists():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _sync_dir(final.parent)


def mark(path: Path, record: dict[str, Any], config_toml: str = "") -> None:
    """Write the commit marker of a fully written DCP folder in place (no rename): `record`
    and the size and checksum of every file. `commit` does this before its rename; a DCP
    folder inside another folder that is committed as a whole (a Hugging Face snapshot's
    `titan_state/`) is marked with this alone."""
    files = collect_checksums(path)
    if config_toml:
        write_synced(path / CONFIG_FILE, config_toml)
        files[CONFIG_FILE] = file_entry(path / CONFIG_FILE)
    marker = {**record, "files": files, "committed_at": time.time()}
    write_synced(path / COMMIT_FILE, _marker_text(marker))


def _marker_text(marker: dict[str, Any]) -> str:
    """JSON with a line per key and per file: readable, and compact however many pieces."""

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(", ", ": "))

    lines = []
    for key, value in marker.items():
        if key == "files":
            inner = ",\n".join(f"  {json.dumps(n)}: {compact(e)}" for n, e in value.items())
            lines.append(f' "files": {{\n{inner}\n }}')
        else:
            lines.append(f" {json.dumps(key)}: {compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def prune(
    folder: str | Path, keep: int, protect: set[Path] = frozenset(), newest: int | None = None
) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (0 keeps all), never one in `protect`.

    With `newest` (the step just saved), only checkpoints up to that step count: a run resumed
    from an older checkpoint (because a newer one failed its checks) never deletes what it
    has just saved, and later steps are replaced when the run gets there."""
    if keep <= 0:
        return []
    found = list_checkpoints(folder)
    if newest is not None:
        found = [(step, path) for step, path in found if step <= newest]
    removed = []
    for _, path in found[:-keep]:
        if path.resolve() in {p.resolve() for p in protect}:
            continue
        discard(path)
        removed.append(path)
    return removed


def checkpoint_bytes(path: str | Path) -> int | None:
    """The bytes a committed checkpoint takes, from the sizes its marker records (data files
    and `.metadata`), or None for a marker without them (another version's)."""
    try:
        files = read_commit(path).get("files") or {}
        return sum(int(entry["bytes"]) for entry in files.values()) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def remove_leftovers(folder: str | Path, skip: set[Path] = frozenset()) -> list[Path]:
    """Delete the remains of interrupted saves, except those in `skip` (a save in flight)."""
    folder = as_path(folder)
    remote = isinstance(folder, RemotePath)
    if not folder.is_dir():
        return []
    skip_names = {p.name for p in skip}
    removed = []
    for entry in folder.iterdir():
        if entry.name in skip_names:
            continue
        # A `step-<N>` without a marker or `.metadata` holds no finished DCP save. One with a
        # file missing, or with `.metadata` but no marker, is kept (and reported when loaded),
        # never deleted behind the user's back.
        # On an object store, a `step-<N>` without a marker is an unfinished save.
        incomplete_step = (
            _STEP.match(entry.name)
            and not _has_marker(entry)
            and (remote or not _has_metadata(entry))
        )
        if _LEFTOVER.match(entry.name) or incomplete_step:
            discard(entry)
            removed.append(entry)
    return removed
