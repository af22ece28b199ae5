"""Ways a checkpoint folder goes bad after its commit, done to real files: cut short, filled
with garbage, one value overwritten in place, an unreadable marker, a lost `.metadata`, and
files planted to run code."""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

from titan_ckpt import load_consolidated
from titan_ckpt.integrity import file_entry
from titan_ckpt.safe_read import read_metadata_file

COMMIT = "titan_commit.json"


def data_file(step_dir: Path) -> Path:
    (path,) = step_dir.glob("*.distcp")
    return path


def truncate(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def fill_with_garbage(path: Path) -> None:
    """Same size, other bytes: what a bad disk block or a stray write leaves."""
    size = path.stat().st_size
    path.write_bytes(bytes((i * 7 + 3) % 251 for i in range(size)))


def overwrite_value(step_dir: Path, key: str, value: float) -> None:
    """Overwrite the first element of the saved tensor `key` (e.g. "model.embed.weight") in
    place, leaving every size and the file's structure intact: it still loads."""
    tensor = load_consolidated(step_dir, "", progress=False)[key]
    metadata = read_metadata_file(step_dir / ".metadata")
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == key]
    path = step_dir / info.relative_path
    data = bytearray(path.read_bytes())
    start = data.find(tensor.numpy().tobytes()[:64], info.offset, info.offset + info.length)
    assert start >= 0, f"the bytes of {key} were not found in {path}"
    data[start : start + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(data))


def break_commit(step_dir: Path) -> None:
    """A marker that cannot be read: not UTF-8, not JSON (root can read any file, so a mode
    change would not do)."""
    (step_dir / COMMIT).write_bytes(b"\xff\xfe{ not a commit record")


def drop_checksums(step_dir: Path) -> None:
    """Make the marker look like one written before checksums existed (titan-ckpt 0.1.0)."""
    record = json.loads((step_dir / COMMIT).read_text())
    record.pop("files", None)
    (step_dir / COMMIT).write_text(json.dumps(record))


def rechecksum(step_dir: Path, name: str) -> None:
    """Record `name`'s current checksum in the marker, as someone who can write the folder
    (and wants a changed file accepted) would."""
    record = json.loads((step_dir / COMMIT).read_text())
    record["files"][name] = file_entry(step_dir / name)
    (step_dir / COMMIT).write_text(json.dumps(record))


class _RunCommand:
    """Unpickling this runs `command` through os.system, as a planted file would."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def plant_metadata(step_dir: Path, command: str) -> None:
    """Replace `.metadata` with a pickle that runs `command` when plain `pickle.load` reads it."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_RunCommand(command)))


class Payload:
    """A Stateful whose saved state runs `command` when read back with plain pickle."""

    def __init__(self, command: str):
        self.command = command

    def state_dict(self):
        return {"hook": _RunCommand(self.command)}

    def load_state_dict(self, state):
        pass
