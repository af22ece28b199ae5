"""What makes a checkpoint trustworthy beyond being complete: a checksum of every byte, and no
NaN or inf among the saved values.

Checksums cost almost nothing because they are computed on bytes already in motion:
- **Saving.** `ChecksummingWriter` is DCP's FileSystemWriter whose streams hash what DCP's
  writer threads write, as they write it (xxHash XXH3-128, several GB/s per core). A data file
  is hashed in pieces that end where DCP ends an item (at least `PIECE_BYTES` each), so that a
  load that reads only some items (another layout, one state) can check just those. Each rank
  leaves `<file>.sum.json` next to each of its files; the commit moves them into the marker.
- **Loading.** `PieceVerifier` checks the pieces that a DCP read plan touches, in a thread of
  its own, each right after DCP has read it (see safe_read.SafeFileSystemReader): from the
  page cache, so the bytes come off the disk once; every byte a resume uses has matched its
  checksum once the load returns.
- **Offline.** `verify_files` checks whole files (`titan-ckpt verify`).

On an object store (a URL folder) the writer is torch's FsspecWriter with the same hashing
streams, and a load's checker reads the pieces back by byte range.

Markers written by earlier versions hold one SHA-256 per file (`{"bytes": n, "sha256": hex}`);
they are verified with the algorithm they name, before the load reads anything.
"""

from __future__ import annotations

import bisect
import json
import math
import mmap
import os
import queue
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemWriter, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from titan_ckpt.storage import RemotePath, as_path, filesystem, is_url

ALGORITHM = "xxh3_128"
LEGACY_ALGORITHM = "sha256"
"""Whole-file SHA-256 of titan-ckpt's first checksummed markers: still verified."""
PIECE_BYTES = 1 << 20
"""A data file's pieces are at least this long (except the last): a marker holds at most one
entry per MiB, and a partial read checks at most a MiB on either side of what it reads."""
OVERLAP_BYTES = 1 << 20
"""Writes at least this long are hashed by a second thread while they are written."""
SUM_SUFFIX = ".sum.json"
"""Side file `<data file>.sum.json` a rank writes next to each data file; merged at commit."""


class CorruptDataError(RuntimeError):
    """Bytes read from a checkpoint differ from those its marker recorded."""


def _digest(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(data)


# ----------------------------------------------------------------------------- saving
class _HashingStream:
    """A file DCP writes through: every byte is hashed on its way to the file, a large write
    by a thread of the stream's own while this thread writes it (both release the GIL, and
    the write returns only once both are done, so the caller's buffer outlives them). DCP asks
    for the position (`tell`) before and after each item; a piece ends there once it is long
    enough."""

    def __init__(self, file: Any):
        self._file = file
        self._hash = xxhash.xxh3_128()
        self._start = self._pos = 0
        self._hasher: ThreadPoolExecutor | None = None
        self.pieces: list[list[Any]] = []

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < OVERLAP_BYTES:
            written = self._file.write(view)
            self._hash.update(view[:written])
        else:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-hash")
            hashed = self._hasher.submit(self._hash.update, view)
            try:
                written = self._file.write(view)
            finally:
                hashed.result()
            if written != view.nbytes:  # never for a buffered file: it writes all or raises
                raise OSError(f"short write of {written} of {view.nbytes} bytes")
        self._pos += written
        return written

    def tell(self) -> int:
        if self._pos - self._start >= PIECE_BYTES:
            self._cut()
        return self._pos

    def _cut(self) -> None:
        self.pieces.append([self._start, self._pos - self._start, self._hash.hexdigest()])
        self._hash.reset()
        self._start = self._pos

    def entry(self) -> dict[str, Any]:
        if self._pos > self._start:
            self._cut()
        return {"bytes": self._pos, "algorithm": ALGORITHM, "pieces": self.pieces}

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        self.stop()

    def stop(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None


class _HashingFileSystem(FileSystem):
    """DCP's local file system, whose data files hash themselves as they are written."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = Path(path)
        if mode != "wb" or path.suffix != ".distcp":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with path.open("wb") as file:
            stream = _HashingStream(file)
            try:
                yield stream
            finally:
                stream.stop()
        # Written and synced by DCP: record what it holds (not reached if the write failed).
        # No fsync: the sums reach the disk in the commit marker, which is synced, and a save
        # that dies before its commit is discarded whatever its side files hold.
        path.with_name(path.name + SUM_SUFFIX).write_text(json.dumps(stream.entry()))


def _fsspec_file_system_class() -> type:
    """torch's fsspec FileSystem class (`_FileSystem` in fsspec_filesystem, or `FileSystem` in
    torch 2.11's _fsspec_filesystem): the module that defines FsspecWriter holds it."""
    module = sys.modules[FsspecWriter.__module__]
    return getattr(module, "_FileSystem", None) or module.FileSystem


class _HashingFsspecFileSystem(_fsspec_file_system_class()):
    """DCP's fsspec file system, whose data files hash themselves as they are written (an
    object is stored when its stream closes; its side file is one more object)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        if mode != "wb" or not path.endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as file:
            stream = _HashingStream(file)
            try:
                yield stream
            finally:
                stream.stop()
        self.fs.pipe_file(path + SUM_SUFFIX, json.dumps(stream.entry()).encode())


class ChecksummingWriter(FileSystemWriter):
    """torch's FileSystemWriter that hashes each data file while writing it and records the
    sums in `<file>.sum.json`. Works in DCP's writer threads, in an async save's background
    thread, and in its writer process (the writer is pickled there)."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any):
        super().__init__(path, *args, **kwargs)
        self.fs = _HashingFileSystem()


class ChecksummingFsspecWriter(FsspecWriter):
    """The same for a URL: torch's FsspecWriter with hashing streams. No fsync (an object is
    durable once its upload completes, and fsspec streams have no file descriptor)."""

    def __init__(self, url: str):
        filesystem(url)  # a clear error when the URL's storage is not installed
        super().__init__(url, sync_files=False)
        self.fs = _HashingFsspecFileSystem()
        self.path = self.fs.init_path(url)


def checksumming_writer(path: str | os.PathLike | RemotePath) -> FileSystemWriter:
    """The writer for a save into `path`: a local folder or a URL."""
    if is_url(path):
        return ChecksummingFsspecWriter(str(path))
    return ChecksummingWriter(os.fspath(path))


def write_synced(path: Path | RemotePath, text: str) -> None:
    if isinstance(path, RemotePath):
        path.write_text(text)  # one PUT: the object is there whole, or not at all
        return
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def file_entry(path: str | Path) -> dict[str, Any]:
    """The checksum entry of a small file (`.metadata`, `config.toml`): one piece."""
    data = as_path(path).read_bytes()
    pieces = [[0, len(data), _digest(data)]] if data else []
    return {"bytes": len(data), "algorithm": ALGORITHM, "pieces": pieces}


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


# ----------------------------------------------------------------------------- checking
def entry_problem(entry: Any) -> str | None:
    """Why a marker's checksum entry cannot be used, or None: it must name an algorithm this
    version knows, and its pieces must cover the file exactly."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("bytes"), int):
        return "it is not a {bytes, checksum} record"
    if isinstance(entry.get(LEGACY_ALGORITHM), str):
        return None
    if entry.get("algorithm") != ALGORITHM:
        return f"its checksum algorithm {entry.get('algorithm')!r} is not one this version knows ({ALGORITHM}, {LEGACY_ALGORITHM})"
    pieces, end = entry.get("pieces"), 0
    if not isinstance(pieces, list):
        return "it lists no pieces"
    for piece in pieces:
        if not (
            isinstance(piece, list)
            and len(piece) == 3
            and piece[0] == end
            and isinstance(piece[1], int)
            and piece[1] > 0
            and isinstance(piece[2], str)
        ):
            return f"its pieces do not cover the file from byte 0 on (at byte {end:,})"
        end += piece[1]
    if end != entry["bytes"]:
        return f"its pieces cover {end:,} bytes of {entry['bytes']:,}"
    return None


def checked_while_read(entry: Mapping[str, Any]) -> bool:
    """Whether a file's bytes can be checked by the load that reads them (piecewise sums);
    whole-file SHA-256 sums are checked before loading."""
    return entry.get("algorithm") == ALGORITHM


def size_problem(path: Path, expected: Mapping[str, Any]) -> str | None:
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
    return None


def verify_files(
    folder: str | Path,
    expected: Mapping[str, Mapping[str, Any]],
    rank: int = 0,
    world: int = 1,
    *,
    read: bool = True,
) -> list[str]:
    """Problems of the files `rank` checks (every `world`-th, in name order) against `expected`
    ({name: checksum entry}); empty when they match. With `read` False, files whose bytes a
    load checks as it reads them are only checked for their size."""
    folder = as_path(folder)
    problems = []
    for i, name in enumerate(sorted(expected)):
        if i % world != rank:
            continue
        entry = expected[name]
        problem = size_problem(folder / name, entry)
        if problem is None and (read or not checked_while_read(entry)):
            problem = _content_problem(folder / name, entry)
        if problem:
            problems.append(f"{name} {problem}")
    return problems


def _content_problem(path: Path, entry: Mapping[str, Any]) -> str | None:
    try:
        if not checked_while_read(entry):
            import hashlib  # noqa: PLC0415 - only for markers of earlier versions

            with path.open("rb") as f:
                digest = hashlib.file_digest(f, LEGACY_ALGORITHM).hexdigest()
            if digest != entry.get(LEGACY_ALGORITHM):
                return mismatch(LEGACY_ALGORITHM)
            return None
        pieces = entry["pieces"]
        return verify_pieces(path, pieces, range(len(pieces)))
    except OSError as e:
        return f"cannot be read: {e.strerror}"


def mismatch(algorithm: str, start: int | None = None, length: int = 0) -> str:
    where = f" in bytes {start:,}-{start + length:,}" if start is not None else ""
    return f"does not match its {algorithm} checksum{where} (its bytes changed since the save)"


def verify_pieces(path: Path, pieces: list[list[Any]], which: Iterable[int]) -> str | None:
    """Hash the pieces `which` of the file at `path` (read through the page cache, without a
    copy) and compare; the first mismatch, or None."""
    which = sorted(which)
    if not which:
        return None
    if isinstance(path, RemotePath):
        for i in which:
            start, length, digest = pieces[i]
            if _digest(path.read_range(start, length)) != digest:
                return mismatch(ALGORITHM, start, length)
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            for i in which:
                start, length, digest = pieces[i]
                piece = view[start : start + length]
                ok = _digest(piece) == digest
                piece.release()
                if not ok:
                    return mismatch(ALGORITHM, start, length)
        finally:
            view.release()
    return None


def pieces_in(starts: list[int], start: int, length: int) -> range:
    """Indices of the pieces (starting at `starts`, sorted) that hold any of the bytes
    [start, start + length)."""
    first = max(0, bisect.bisect_right(starts, start) - 1)
    last = bisect.bisect_left(starts, start + max(length, 1))
    return range(first, last)


class PieceVerifier(threading.Thread):
    """Checks the pieces of the data files that a read plan touches, in a thread of its own,
    each right after the reader is done with it (while its bytes are still in the page cache):
    the reader reports every item it moves on from (`item_read`), and a piece is hashed once
    every item the plan reads from it was reported. Pieces never reported (a reader that does
    not report, or one that failed) are hashed when the read is over (`finish`).

    `items` are the (file, offset, length) of the plan's read items, with repeats."""

    def __init__(
        self,
        folder: str | Path,
        checksums: Mapping[str, Mapping[str, Any]],
        items: Iterable[tuple[str, int, int]],
    ):
        super().__init__(name="titan-ckpt-verify", daemon=True)
        self.folder = as_path(folder)
        self.checksums = checksums
        self.problems: list[str] = []
        self._starts: dict[str, list[int]] = {}
        self._pending: dict[tuple[str, int], int] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._maps: dict[str, tuple[Any, mmap.mmap, memoryview]] = {}
        for name, offset, length in items:
            entry = checksums.get(name)
            if entry is None:
                self.problems.append(f"{name} has no checksum in the commit marker")
                continue
            if checked_while_read(entry):
                for piece in self._pieces(name, offset, length):
                    self._pending[piece] = self._pending.get(piece, 0) + 1

    def _pieces(self, name: str, offset: int, length: int) -> Iterator[tuple[str, int]]:
        starts = self._starts.get(name)
        if starts is None:
            starts = self._starts[name] = [piece[0] for piece in self.checksums[name]["pieces"]]
        for i in pieces_in(starts, offset, length):
            yield name, i

    def item_read(self, name: str, offset: int, length: int) -> None:
        self._events.put((name, offset, length))

    def finish(self) -> list[str]:
        """Hash what was not yet, wait, and return the problems found."""
        self._events.put(None)
        self.join()
        return self.problems

    def run(self) -> None:
        try:
            while (event := self._events.get()) is not None:
                name, offset, length = event
                if name not in self._starts:
                    continue  # not a file this plan checks
                for piece in self._pieces(name, offset, length):
                    left = self._pending.get(piece)
                    if left is not None:
                        self._pending[piece] = left - 1
                        if left == 1:
                            self._check(piece)
            for piece, left in sorted(self._pending.items()):
                if left > 0:
                    self._check(piece)
        except Exception as e:  # noqa: BLE001 - an unchecked read must never pass as checked
            self.problems.append(f"its checksums could not be checked ({e!r})")
        finally:
            for file, mapped, view in self._maps.values():
                view.release()
                mapped.close()
                file.close()

    def _check(self, piece: tuple[str, int]) -> None:
        name, i = piece
        self._pending[piece] = 0
        start, length, digest = self.checksums[name]["pieces"][i]
        if isinstance(self.folder, RemotePath):  # read back by range: no page cache to reuse
            try:
                ok = _digest((self.folder / name).read_range(start, length)) == digest
            except OSError as e:
                self.problems.append(f"{name} cannot be read: {e.strerror or e}")
                return
            if not ok:
                self.problems.append(f"{name} {mismatch(ALGORITHM, start, length)}")
            return
        try:
            view = self._view(name)
        except OSError as e:
            self.problems.append(f"{name} cannot be read: {e.strerror}")
            return
        chunk = view[start : start + length]
        ok = _digest(chunk) == digest
        chunk.release()
        if not ok:
            self.problems.append(f"{name} {mismatch(ALGORITHM, start, length)}")

    def _view(self, name: str) -> memoryview:
        if name not in self._maps:
            file = open(self.folder / name, "rb")  # noqa: SIM115 - closed when the thread ends
            try:
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except BaseException:
                file.close()
                raise
            self._maps[name] = (file, mapped, memoryview(mapped))
        return self._maps[name][2]


# ----------------------------------------------------------------------------- values
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
