"""What makes a checkpoint trustworthy beyond being complete: a checksum of every file, checked
before anything is loaded, and no NaN or inf among the saved values.

Each rank hashes the files it has just written (`ChecksummingWriter`) into a small side file
next to each of them; the commit moves these sums, plus those of `.metadata` and `config.toml`,
into the commit marker. `verify_files` compares a folder with its marker; in a distributed job
the ranks share the files between them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor
from torch.futures import Future

ALGORITHM = "sha256"
SUM_SUFFIX = ".sum.json"
"""Side file `<data file>.sum.json` a rank writes next to each data file; merged at commit."""


def file_digest(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def file_entry(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return {"bytes": path.stat().st_size, ALGORITHM: file_digest(path)}


class ChecksummingWriter(FileSystemWriter):
    """torch's FileSystemWriter that, once this rank's files are written and synced, records
    each file's size and checksum in `<file>.sum.json`. Hashing reads back what was just
    written, usually from the page cache."""

    def write_data(self, plan, planner) -> Future:
        future = super().write_data(plan, planner)
        results = future.wait()  # FileSystemWriter has finished writing when it returns
        for name in sorted({r.storage_data.relative_path for r in results}):
            path = Path(self.path) / name
            entry = file_entry(path)
            with open(path.with_name(name + SUM_SUFFIX), "w") as f:
                json.dump(entry, f)
                f.flush()
                os.fsync(f.fileno())
        return future


def collect_checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """The checksums of a fully written DCP folder (rank 0, at commit): the side files of the
    data files, which are removed, and `.metadata` hashed here."""
    sums: dict[str, dict[str, Any]] = {}
    for data in sorted(folder.glob("*.distcp")):
        side = data.with_name(data.name + SUM_SUFFIX)
        if not side.is_file():
            raise RuntimeError(f"{data} has no checksum: it was not written by titan-ckpt's writer")
        sums[data.name] = json.loads(side.read_text())
        side.unlink()
    sums[".metadata"] = file_entry(folder / ".metadata")
    return sums


def verify_files(
    folder: str | Path, expected: Mapping[str, Mapping[str, Any]], rank: int = 0, world: int = 1
) -> list[str]:
    """Problems of the files `rank` checks (every `world`-th, in name order) against `expected`
    ({name: {"bytes": n, "sha256": hex}}); empty when they match."""
    folder = Path(folder)
    problems = []
    for i, name in enumerate(sorted(expected)):
        if i % world != rank:
            continue
        problem = _check_file(folder / name, expected[name])
        if problem:
            problems.append(f"{name} {problem}")
    return problems


def _check_file(path: Path, expected: Mapping[str, Any]) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    want = int(expected["bytes"])
    if size != want:
        cut = "truncated" if size < want else "grown"
        return f"has {size:,} bytes, {want:,} when saved ({cut})"
    try:
        digest = file_digest(path)
    except OSError as e:
        return f"cannot be read: {e.strerror}"
    if digest != expected.get(ALGORITHM):
        return f"does not match its {ALGORITHM} checksum (its bytes changed since the save)"
    return None


def nonfinite_entries(state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Names of floating tensors (this rank's shard of a DTensor) and floats holding NaN or inf.

    One fused 2-norm per device and dtype and one read back: a norm is finite exactly when every
    element is, except when the squares overflow, and only those tensors are checked element
    by element. (The 2-norm is several times faster than the max-abs norm on CPU.)"""
    names: list[str] = []
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[str], list[torch.Tensor]]] = {}
    for key, value in _flatten(state_dict, prefix):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel() > 0:
                keys, tensors = groups.setdefault((value.device, value.dtype), ([], []))
                keys.append(key)
                tensors.append(value.detach())
        elif isinstance(value, float) and not math.isfinite(value):
            names.append(key)
    for keys, tensors in groups.values():
        norms = torch.stack(torch._foreach_norm(tensors, 2.0))
        suspects = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        names.extend(keys[i] for i in suspects if not bool(torch.isfinite(tensors[i]).all()))
    return names


def _flatten(tree: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}.{i}")
    else:
        yield prefix, tree
