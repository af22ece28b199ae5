"""Reading and writing DCP folders outside a training job: safe loading, consolidation to one
process, and writing a plain state dict as a committed checkpoint."""

from __future__ import annotations

import io
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from tqdm import tqdm

from titan_ckpt import layout

# DCP warns on every single-process save/load that it assumes one process; here that is the intent.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values are unpickled with
    `weights_only=True`: a checkpoint can hold plain Python values and tensors, never code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def checkpoint_keys(path: str | Path) -> dict[str, Any]:
    """The flattened keys a DCP folder holds, with their storage metadata."""
    return dict(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_consolidated(
    path: str | Path, prefix: str = "model.", *, progress: bool = True, chunk_bytes: int = 1 << 30
) -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` of a DCP folder as one unsharded CPU state dict (prefix
    removed), read in one process whatever layout wrote it."""
    meta = {k: v for k, v in checkpoint_keys(path).items() if k.startswith(prefix)}
    tensors = {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    if not tensors:
        raise ValueError(
            f"{path} holds no tensors under {prefix!r}; keys start with: {_heads(path)}"
        )
    out: dict[str, torch.Tensor] = {}
    total = sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors.values())
    reader = dcp.FileSystemReader(str(path))
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
                out.update({k[len(prefix) :]: v for k, v in chunk.items()})
                bar.update(size)
                chunk, size = {}, 0
    return out


def _heads(path: str | Path) -> str:
    return ", ".join(sorted({k.split(".", 1)[0] for k in checkpoint_keys(path)}))


def save_model_checkpoint(
    state_dict: dict[str, torch.Tensor], path: str | Path, step: int = 0
) -> Path:
    """Write `state_dict` as a committed, model-only checkpoint folder `path` (one process)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    final.parent.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": state_dict}, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
    record = {
        "step": step,
        "states": ["model"],
        "model_only": True,
        "world_size": 1,
        "dp_world_size": 1,
    }
    layout.commit(tmp, final, record)
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


def _decode(blob: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


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
        storage_reader=dcp.FileSystemReader(str(path)),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return {k[len(prefix) :]: v for k, v in wanted.items()}
