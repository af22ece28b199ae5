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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from titan_ckpt.integrity import CorruptDataError, PieceVerifier
from titan_ckpt.storage import RemotePath, as_path, filesystem, is_url

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


def read_metadata_file(path: str | Path | RemotePath) -> Metadata:
    """A DCP `.metadata` file (local or at a URL), unpickled with only the classes DCP
    metadata consists of."""
    with as_path(path).open("rb") as f:
        metadata = _MetadataUnpickler(f, str(path)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"refused to read {path}: it holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


class _SafeReading:
    """torch's FileSystemReader (or FsspecReader) with `.metadata` read by `read_metadata_file`.

    With `checksums` (the marker's {file: checksum entry}), the pieces of the data files that
    a read plan touches are hashed by a thread of their own (`PieceVerifier`), each as soon as
    DCP has moved on from the items it reads there, and the read fails with CorruptDataError,
    naming the file and the bytes, when any differs. Corrupt bytes may reach the weights_only
    deserialiser before the verdict: the caller treats the states it read into as touched, as
    after any failed read."""

    def __init__(self, path: str, checksums: Mapping[str, Mapping[str, Any]] | None = None):
        super().__init__(path)
        self.checksums = checksums
        self._verifier: PieceVerifier | None = None
        self._reading: tuple[str, int, int] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(str(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future:
        if self.checksums is None:
            return super().read_data(plan, planner)
        items = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            items.append((info.relative_path, info.offset, info.length))
        self._verifier = verifier = PieceVerifier(str(self.path), self.checksums, items)
        verifier.start()
        try:
            done = super().read_data(plan, planner)
        except BaseException as e:
            problems = self._finish()
            if problems:  # the reason the read failed, most likely
                raise CorruptDataError(problems[0]) from e
            raise
        problems = self._finish()
        if problems:
            raise CorruptDataError("; ".join(problems))
        return done

    def _finish(self) -> list[str]:
        self._moved_on()
        verifier, self._verifier = self._verifier, None
        return verifier.finish()

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        # DCP reads the items one after the other: a new item means it is done with the last.
        if self._verifier is not None:
            self._moved_on()
            self._reading = (sinfo.relative_path, sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    def _moved_on(self) -> None:
        if self._reading is not None and self._verifier is not None:
            self._verifier.item_read(*self._reading)
        self._reading = None


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """A local checkpoint folder, read safely (see `_SafeReading`)."""


class SafeFsspecReader(_SafeReading, FsspecReader):
    """A checkpoint at a URL, read safely through torch's FsspecReader (see `_SafeReading`)."""

    def __init__(self, url: str, checksums: Mapping[str, Mapping[str, Any]] | None = None):
        filesystem(url)  # a clear error when the URL's storage is not installed
        super().__init__(url, checksums)


def safe_reader(
    path: str | Path | RemotePath, checksums: Mapping[str, Mapping[str, Any]] | None = None
) -> FileSystemReader:
    """The safe reader for a checkpoint folder, local or at a URL."""
    if is_url(path):
        return SafeFsspecReader(str(path), checksums)
    return SafeFileSystemReader(str(path), checksums)


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
