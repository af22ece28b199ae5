"""Reading a checkpoint folder without running code from it.

DCP stores its `.metadata` with pickle and reads it back with plain `pickle.load`, which runs
whatever a planted file asks for. `SafeFileSystemReader` reads it through an unpickler that
admits only the classes DCP metadata is made of (its metadata dataclasses, torch.Size, dtypes,
layouts, memory formats and paths); anything else is refused with `UnsafeCheckpointError`
before it is called. Tensors and serialised states are read with `torch.load(weights_only=True)`,
whose refusals are reworded by `load_plain` without torch's advice to retry unsafely.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from titan_ckpt.integrity import CorruptDataError, checked_while_read, pieces_in, verify_pieces

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_METADATA_MODULE, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to load something that is not plain checkpoint data."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)  # torch.float32, torch.strided, ...
        raise UnsafeCheckpointError(
            f"refused to read {self.path}: it asks to load {module}.{name}, which DCP metadata "
            "never holds; a checkpoint is data and never runs code, so this file was written or "
            "changed by something else. Do not load it; find out who wrote it, and delete it"
        )


def read_metadata_file(path: str | Path) -> Metadata:
    """A DCP `.metadata` file, unpickled with only the classes DCP metadata consists of."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"refused to read {path}: it holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by `read_metadata_file`.

    With `checksums` (the marker's {file: checksum entry}), the pieces of the data files that
    a read plan touches are hashed in a thread of its own while DCP reads them, and the read
    fails with CorruptDataError, naming the file and the bytes, when any differs. Corrupt bytes
    may reach the (weights_only) deserialiser before the verdict: the caller treats the states
    it read into as touched, as after any failed read."""

    def __init__(self, path: str, checksums: Mapping[str, Mapping[str, Any]] | None = None):
        super().__init__(path)
        self.checksums = checksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        if self.checksums is None:
            return super().read_data(plan, planner)
        verdict: list[str] = []
        checker = threading.Thread(
            target=self._check_into, args=(plan, verdict), name="titan-ckpt-verify"
        )
        checker.start()
        try:
            done = super().read_data(plan, planner)
        except BaseException as e:
            checker.join()
            if verdict:  # the reason the read failed, most likely
                raise CorruptDataError(verdict[0]) from e
            raise
        checker.join()
        if verdict:
            raise CorruptDataError("; ".join(verdict))
        return done

    def _check_into(self, plan: Any, verdict: list[str]) -> None:
        try:
            verdict.extend(self._check(plan))
        except Exception as e:  # noqa: BLE001 - an unchecked read must never pass as checked
            verdict.append(f"its checksums could not be checked ({e!r})")

    def _check(self, plan: Any) -> list[str]:
        wanted: dict[str, set[int]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            entry = self.checksums.get(info.relative_path)
            if entry is None:
                return [f"{info.relative_path} has no checksum in the commit marker"]
            if checked_while_read(entry):
                wanted.setdefault(info.relative_path, set()).update(
                    pieces_in(entry["pieces"], info.offset, info.length)
                )
        problems = []
        for name, which in sorted(wanted.items()):
            try:
                problem = verify_pieces(
                    Path(self.path) / name, self.checksums[name]["pieces"], which
                )
            except OSError as e:
                problem = f"cannot be read: {e.strerror}"
            if problem:
                problems.append(f"{name} {problem}")
        return problems


def load_plain(data: bytes | io.BytesIO, what: str) -> Any:
    """`torch.load(weights_only=True)` of a serialised state; a refusal names `what` and the
    offending object, and never suggests loading with weights_only=False."""
    buffer = io.BytesIO(data) if isinstance(data, bytes) else data
    try:
        return torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"refused to load {what}: {weights_only_reason(e)}; a checkpoint holds tensors and "
            "plain Python values only, and never runs code"
        ) from None


def weights_only_reason(error: BaseException) -> str:
    """The reason in torch's weights_only refusal, without its advice to load unsafely."""
    skip = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept = [line for line in lines if not line.startswith(skip)]
    return " ".join(kept[:2]) or type(error).__name__
