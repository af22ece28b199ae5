"""Reading and writing DCP folders outside a training job: safe loading, consolidation to one
process, and writing a plain state dict as a committed checkpoint."""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from tqdm import tqdm

from titan_ckpt import layout
from titan_ckpt.integrity import ChecksummingWriter, nonfinite_entries, verify_files
from titan_ckpt.safe_read import SafeFileSystemReader, load_plain, read_metadata_file

# DCP warns on every single-process save/load that it assumes one process; here that is the intent.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values are unpickled with
    `weights_only=True`: a checkpoint can hold plain Python values and tensors, never code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = load_plain(value, f"checkpoint entry {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def checkpoint_keys(path: str | Path) -> dict[str, Any]:
    """The flattened keys a DCP folder holds, with their storage metadata (read without
    running code, see safe_read.py)."""
    return dict(read_metadata_file(Path(path) / ".metadata").state_dict_metadata)


def checkpoint_problems(path: str | Path, rank: int = 0, world: int = 1) -> list[str]:
    """Why the checkpoint folder `path` cannot be trusted, or an empty list: a commit marker
    that cannot be read, no `.metadata`, a file whose size or checksum differs from what the
    marker recorded (cut short, overwritten, replaced), or metadata that asks to run code.

    Reads every byte once. With `rank` and `world`, this process checks only its share of the
    data files (`.metadata` and the marker are checked by all); merge the ranks' lists."""
    path = Path(path)
    try:
        record = layout.read_commit(path)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [f"its commit marker {layout.COMMIT_FILE} cannot be read ({reason})"]
    if not (path / ".metadata").is_file():
        return ["it has no .metadata (DCP's index of the saved tensors)"]
    files = record.get("files") or {}
    try:
        problems = verify_files(path, {k: v for k, v in files.items() if k == ".metadata"})
        data = {name: entry for name, entry in files.items() if name != ".metadata"}
        problems += verify_files(path, data, rank, world)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # every rank must answer
        return [f"its commit marker lists checksums in a form this version cannot read ({e!r})"]
    if not problems:
        try:
            read_metadata_file(path / ".metadata")
        except Exception as e:  # noqa: BLE001 - any failure to read it is the problem
            problems.append(str(e) if str(e) else type(e).__name__)
    return problems


def load_consolidated(
    path: str | Path, prefix: str = "model.", *, progress: bool = True, chunk_bytes: int = 1 << 30
) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` of a DCP folder as one unsharded CPU state dict (prefix
    removed), read in one process whatever layout wrote it."""
    out: dict[str, torch.Tensor] = {}
    for chunk in _chunks(path, prefix, progress=progress, chunk_bytes=chunk_bytes):
        out.update({k[len(prefix) :]: v for k, v in chunk.items()})
    return out


def nonfinite_tensors(
    path: str | Path, prefixes: tuple[str, ...] = ("model.", "optimizer."), *, progress: bool = True
) -> list[str]:
    """Names of the saved floating tensors under `prefixes` that hold NaN or inf, read a chunk
    at a time in one process (for checkpoints written by tools that do not check this)."""
    keys = checkpoint_keys(path)
    bad: list[str] = []
    for prefix in prefixes:
        if any(
            k.startswith(prefix) and isinstance(v, TensorStorageMetadata) for k, v in keys.items()
        ):
            for chunk in _chunks(path, prefix, progress=progress, chunk_bytes=1 << 28):
                bad += nonfinite_entries(chunk)
    return bad


def _chunks(
    path: str | Path, prefix: str, *, progress: bool, chunk_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The unsharded tensors under `prefix`, about `chunk_bytes` at a time."""
    meta = {k: v for k, v in checkpoint_keys(path).items() if k.startswith(prefix)}
    tensors = {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    if not tensors:
        raise ValueError(
            f"{path} holds no tensors under {prefix!r}; keys start with: {_heads(path)}"
        )
    total = sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors.values())
    reader = SafeFileSystemReader(str(path))
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"read {Path(path).name}", disable=not progress
    ) as bar:
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for i, (key, m) in enumerate(tensors.items()):
            chunk[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            size += chunk[key].nbytes
            if size >= chunk_bytes or i == len(tensors) - 1:
                dcp.load(chunk, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
                bar.update(size)
                yield chunk
                chunk, size = {}, 0


def _heads(path: str | Path) -> str:
    return ", ".join(sorted({k.split(".", 1)[0] for k in checkpoint_keys(path)}))


def save_model_checkpoint(
    state_dict: dict[str, torch.Tensor], path: str | Path, step: int = 0
) -> Path:
    """Write `state_dict` as a committed, model-only checkpoint folder `path`: by one process,
    or, when a process group is up, by every rank (a collective), each writing its own shards
    of the DTensors, rank 0 committing."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    final.parent.mkdir(parents=True, exist_ok=True)
    group = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if group else 1
    dcp.save({"model": state_dict}, storage_writer=ChecksummingWriter(str(tmp)), no_dist=not group)
    if group:
        dist.barrier()  # every rank's files and checksums are written
    if not group or dist.get_rank() == 0:
        record = {
            "step": step,
            "states": ["model"],
            "model_only": True,
            "world_size": world,
            "dp_world_size": world,
        }
        layout.commit(tmp, final, record)
    if group:
        dist.barrier()
    return final


NATIVE_STATES = ("model", "optimizer")
"""States DCP stores tensor by tensor (and reshards); every other state is one serialised blob
per entry (see titan_ckpt.states.BlobState)."""


def dcp_to_torch_file(
    path: str | Path, out_file: str | Path, *, model_only: bool = False, progress: bool = True
) -> None:
    """Consolidate a DCP folder into one `torch.save` file (tensors and plain values only, so it
    loads back with `torch.load(..., weights_only=True)`): {"model": {fqn: tensor}, "optimizer":
    {...}, "train_state": {...}, "dataloader": {"dp0": {...}}, ...}."""
    keys = checkpoint_keys(path)
    heads = ["model"] if model_only else sorted({k.split(".", 1)[0] for k in keys})
    state: dict[str, Any] = {}
    for head in heads:
        prefix = head + "."
        if head in NATIVE_STATES:
            has_tensors = any(
                isinstance(m, TensorStorageMetadata)
                for k, m in keys.items()
                if k.startswith(prefix)
            )
            flat = load_consolidated(path, prefix, progress=progress) if has_tensors else {}
            flat.update(_load_values(path, prefix, keys))
            state[head] = flat
        else:
            blobs = {
                k: _decode(v) for k, v in load_consolidated(path, prefix, progress=False).items()
            }
            state[head] = blobs["state"] if list(blobs) == ["state"] else blobs
    start = time.perf_counter()
    torch.save(state, str(out_file))
    if progress:
        tqdm.write(f"wrote {out_file} in {time.perf_counter() - start:.1f}s")


def _decode(blob: torch.Tensor, what: str = "a serialised state") -> Any:
    return load_plain(blob.numpy().tobytes(), what)


def _load_values(path: str | Path, prefix: str, keys: dict[str, Any]) -> dict[str, Any]:
    """Non-tensor entries under `prefix`, flat (`a.b.c` keys), read safely."""
    wanted = {
        k: None
        for k, v in keys.items()
        if k.startswith(prefix) and not isinstance(v, TensorStorageMetadata)
    }
    if not wanted:
        return {}
    dcp.load(
        wanted,
        storage_reader=SafeFileSystemReader(str(path)),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return {k[len(prefix) :]: v for k, v in wanted.items()}
