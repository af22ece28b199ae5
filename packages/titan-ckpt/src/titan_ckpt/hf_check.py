"""Whether the safetensors files of a Hugging Face folder can be read, checked from their
headers alone before any process group or model exists.

safetensors itself decides (its `safe_open` checks the header's length, its JSON and that the
tensors' byte ranges cover the data exactly); what it finds is said here in plain words, with
the numbers that show it: the length the header claims against the file's size, the data the
header describes against the data the file holds. A safetensors file is an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range
in the data that follows, then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from safetensors import SafetensorError, safe_open

from titan_core.protocols import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEADER_LIMIT = 100_000_000
"""The longest header safetensors reads (its own limit)."""


class HFFilesError(CheckpointError, ValueError):
    """A Hugging Face folder whose index or safetensors files cannot be read; the message
    names each file and why (a `CheckpointError`, which the trainer prints without a
    traceback, and a `ValueError`, as the errors of a bad folder were)."""


def weight_files(folder: str | Path) -> list[str]:
    """The weight files of an HF folder: those its index names, or its one `model.safetensors`,
    or every `*.safetensors` in it. HFFilesError when there are none or the index is broken."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise HFFilesError(
                f"{index} cannot be read: {type(e).__name__}: {e} (it must be JSON with a"
                ' "weight_map" of tensor names to files)\ndownload the folder again'
            ) from e
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise HFFilesError(f"{folder} holds no .safetensors files (nor {INDEX_FILE})")
    return files


def safetensors_problems(folder: str | Path) -> list[str]:
    """Each weight file of the HF folder `folder` that cannot be read, with the reason; empty
    when every one opens. Reads the headers only."""
    folder = Path(folder)
    try:
        files = weight_files(folder)
    except HFFilesError as e:
        return [str(e)]
    problems = []
    for name in files:
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is named by {INDEX_FILE} but does not exist")
            continue
        reason = file_problem(path)
        if reason is not None:
            problems.append(f"{path}: {reason}")
    return problems


def check_safetensors_folder(folder: str | Path) -> None:
    """HFFilesError naming every weight file of `folder` that cannot be read, and the fix."""
    problems = safetensors_problems(folder)
    if problems:
        raise HFFilesError(
            "the Hugging Face weights cannot be read:\n  "
            + "\n  ".join(problems)
            + "\ndownload the damaged files again (titan-download, or the hub's own tools), or"
            " point at another copy"
        )


def file_problem(path: Path) -> str | None:
    """Why safetensors cannot open `path`, in plain words, or None when it can."""
    try:
        with safe_open(str(path), framework="numpy"):
            return None
    except SafetensorError as e:
        library = str(e).removeprefix("Error while deserializing header: ")
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    return _explain(path, library)


def _explain(path: Path, library: str) -> str:
    """safetensors' reason (`library`), with the numbers from the file that show it."""
    size = path.stat().st_size
    damaged = "; the file is damaged or not a safetensors file"
    if size < 8:
        return f"it has {size} bytes, fewer than a safetensors header's 8-byte length{damaged}"
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, HEADER_LIMIT):
            return (
                f"its header claims {length:,} bytes, but the file holds {size - 8:,} after the"
                f" length field{damaged} (safetensors: {library})"
            )
        header = f.read(length)
    try:
        tensors = json.loads(header)
        ends = [
            int(entry["data_offsets"][1]) for key, entry in tensors.items() if key != "__metadata__"
        ]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        return f"its header is not a valid safetensors header ({e}){damaged}"
    held = size - 8 - length
    described = max(ends, default=0)
    if described != held:
        return (
            f"its header describes {described:,} bytes of tensor data, the file holds {held:,}"
            f" ({'truncated' if described > held else 'extra bytes at the end'}, or a header"
            f" that names a tensor past the end){damaged}"
        )
    return f"safetensors cannot open it: {library}{damaged}"
