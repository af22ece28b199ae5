"""The safetensors files of a Hugging Face folder, read and written box by box.

Reading goes through safetensors' `get_slice`, which maps the file and copies out only the
box asked for: the pages of the rest are never touched. Each read opens the file afresh, so
that the mapping (and the pages it brought into this process) goes when the box has been
used.

Writing is planned from the full shapes alone: which file holds each tensor and at which
byte, so every rank computes the same plan. Rank 0 writes each file's header and sizes the
file; then every rank writes the bytes of its own boxes in place (`os.pwrite`), a run of
contiguous bytes at a time, and no rank ever holds a whole file or the whole model. The
format is safetensors' own (an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, the data): the files are read by safetensors and
`transformers` like any others.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from titan_ckpt.hf_check import (
    INDEX_FILE,
    SINGLE_FILE,
    check_safetensors_folder,
    weight_files,
)
from titan_core.protocols import Box, HFSlice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The export dtypes, by the names configs use."""

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
"""safetensors' name of each dtype."""
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class StoredTensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsFolder:
    """The tensors of an HF folder by name (from the files' headers), read a box at a time."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.tensors: dict[str, StoredTensor] = {}
        check_safetensors_folder(self.folder)  # a damaged file named, not a library error
        for file in weight_files(self.folder):
            with safe_open(str(self.folder / file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    stored = f.get_slice(name)
                    dtype = DTYPES_BY_NAME.get(stored.get_dtype())
                    if dtype is None:
                        raise ValueError(
                            f"{name} in {self.folder / file} has dtype {stored.get_dtype()},"
                            " which Titan does not read"
                        )
                    self.tensors[name] = StoredTensor(file, dtype, tuple(stored.get_shape()))

    def meta_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its dtype and shape (no data)."""
        return {
            name: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for name, t in self.tensors.items()
        }

    def read(self, hf: HFSlice) -> torch.Tensor:
        """The box `hf.index` of the tensor `hf.name`, whose full shape must be `hf.shape`.
        The result may be a view of the mapped file: use it, then let it go."""
        stored = self.tensors.get(hf.name)
        if stored is None:
            raise KeyError(f"{hf.name} is not in {self.folder}")
        if stored.shape != tuple(hf.shape):
            raise ValueError(
                f"{hf.name} in {self.folder / stored.file} has shape {list(stored.shape)}, and the"
                f" model expects {list(hf.shape)}"
            )
        with safe_open(str(self.folder / stored.file), framework="pt", device="cpu") as f:
            if not hf.index:
                return f.get_tensor(hf.name)
            return f.get_slice(hf.name)[hf.index]


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class PlannedTensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Byte offset of its data in the file."""


@dataclass(frozen=True)
class FilePlan:
    """Where every tensor of an export goes: files, headers and byte offsets."""

    tensors: dict[str, PlannedTensor]
    headers: dict[str, bytes]
    sizes: dict[str, int]
    total_bytes: int

    @property
    def files(self) -> list[str]:
        return list(self.headers)


def plan_files(
    tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int
) -> FilePlan:
    """Lay out tensors (name -> (shape, dtype)) in files of at most `max_shard_bytes` (a tensor
    larger than that gets a file of its own), in natural name order, so that each block's
    tensors stay together: `model.safetensors` when one file holds all, else
    `model-0000i-of-0000n.safetensors` as `save_pretrained` names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=_natural):
        shape, dtype = tensors[name]
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    planned: dict[str, PlannedTensor] = {}
    headers: dict[str, bytes] = {}
    sizes: dict[str, int] = {}
    for i, names in enumerate(groups):
        file = (
            SINGLE_FILE
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            shape, dtype = tensors[name]
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, end],
            }
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        headers[file] = len(text).to_bytes(8, "little") + text
        sizes[file] = len(headers[file]) + offset
        for name in names:
            begin = header[name]["data_offsets"][0]  # type: ignore[index]
            shape, dtype = tensors[name]
            planned[name] = PlannedTensor(file, dtype, tuple(shape), len(headers[file]) + begin)
    total = sum(math.prod(s) * d.itemsize for s, d in tensors.values())
    return FilePlan(planned, headers, sizes, total)


def create_files(folder: Path, plan: FilePlan) -> list[Path]:
    """Write each file's header and give it its full size (the data still zeros, as a sparse
    file), and the index when there are several files. Done by one rank, before any writes."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file, header in plan.headers.items():
        path = folder / file
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(plan.sizes[file])
        written.append(path)
    if len(plan.headers) > 1:
        weight_map = {name: t.file for name, t in sorted(plan.tensors.items())}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
        written.append(folder / INDEX_FILE)
    return written


class BoxWriter:
    """Writes boxes of planned tensors into files `create_files` made (each rank its own)."""

    def __init__(self, folder: Path, plan: FilePlan):
        self.folder, self.plan = folder, plan
        self._fds: dict[str, int] = {}

    def write(self, hf: HFSlice, tensor: torch.Tensor) -> None:
        target = self.plan.tensors[hf.name]
        data = tensor.detach().to("cpu", target.dtype).contiguous()
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        fd = self._fds.get(target.file)
        if fd is None:
            fd = self._fds[target.file] = os.open(self.folder / target.file, os.O_WRONLY)
        done = 0
        for offset, length in byte_runs(target.shape, hf.index, target.dtype.itemsize):
            chunk, position = raw[done : done + length], target.start + offset
            while chunk:  # pwrite may write less than asked
                written = os.pwrite(fd, chunk, position)
                chunk, position = chunk[written:], position + written
            done += length

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def byte_runs(shape: tuple[int, ...], index: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """The contiguous byte runs (offset, length) of box `index` in a row-major tensor of
    `shape`, in the order of the box's own row-major bytes."""
    if not shape:
        yield 0, itemsize
        return
    # The dimensions after `inner` are whole; a run spans them and `inner`'s part of the box.
    inner = len(shape) - 1
    while inner > 0 and (index[inner].start, index[inner].stop) == (0, shape[inner]):
        inner -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = (index[inner].stop - index[inner].start) * strides[inner] * itemsize
    if length == 0:
        return
    outer = [range(s.start, s.stop) for s in index[:inner]]
    for position in itertools.product(*outer):
        element = sum(p * strides[d] for d, p in enumerate(position))
        yield (element + index[inner].start * strides[inner]) * itemsize, length


def _natural(name: str) -> list[object]:
    """Sort key that puts layer 2 before layer 10."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]
