"""DCP checkpoints to and from Hugging Face folders, by one process or by every rank of a
`torchrun` job, each holding 1/world of every tensor (`titan-ckpt convert`).

Each rank holds a row block of every tensor (a DTensor sharded on its first dimension over a
1-D mesh of all ranks): DCP reads and writes only those rows of the checkpoint, and
`hf_sharded` only the boxes of the safetensors files they need. Neither direction builds the
model: the tensors' names and shapes are the checkpoint's (its metadata, or the adapter's
reading of the safetensors headers). One process is the same with whole tensors.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from tqdm import tqdm

from titan_ckpt.dcp_io import SafeLoadPlanner, checkpoint_keys, save_model_checkpoint
from titan_ckpt.hf_files import DTYPES, SafetensorsFolder
from titan_ckpt.hf_sharded import load_hf_weights, save_hf_weights
from titan_ckpt.safe_read import safe_reader
from titan_core.protocols import HFAdapter

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def world_mesh() -> DeviceMesh | None:
    """A 1-D CPU mesh of every rank when a process group of several ranks is up, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return init_device_mesh("cpu", (dist.get_world_size(),))


def empty_shards(shapes: Shapes, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of `shapes`: whole without a mesh, else this rank's row block
    (Shard(0); a 0-d tensor is replicated)."""
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in shapes.items():
        if mesh is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        placements = [Shard(0)] if shape else [Replicate()]
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        strides = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        out[name] = DTensor.from_local(
            torch.empty(local_shape, dtype=dtype),
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=strides,
        )
    return out


def dcp_to_hf(
    ckpt: str | Path,
    out: str | Path,
    adapter: HFAdapter,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = False,
) -> list[Path]:
    """The model of the DCP checkpoint `ckpt` as a Hugging Face folder `out` (every rank
    calls it; each reads and writes its row block of every tensor)."""
    prefix = "model."
    shapes: Shapes = {
        key[len(prefix) :]: (tuple(meta.size), meta.properties.dtype)
        for key, meta in checkpoint_keys(ckpt).items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not shapes:
        raise ValueError(f"{ckpt} holds no model tensors (no keys under {prefix!r})")
    mesh = world_mesh()
    state = empty_shards(shapes, mesh)
    local = sum(_local(t).nbytes for t in state.values())
    # One bar for this rank's share: DCP reads it in one call (its own threads, in parallel).
    with tqdm(
        total=local, unit="B", unit_scale=True, desc=f"read {Path(str(ckpt)).name}",
        disable=not progress,
    ) as bar:  # fmt: skip
        dcp.load(
            {"model": state},
            storage_reader=safe_reader(ckpt),
            planner=SafeLoadPlanner(),
            no_dist=mesh is None,
        )
        bar.update(local)
    return save_hf_weights(
        state, adapter, out, dtype=dtype, max_shard_bytes=max_shard_bytes, progress=progress
    )


def hf_to_dcp(
    folder: str | Path,
    out: str | Path,
    adapter: HFAdapter,
    *,
    dtype: str | None = None,
    step: int = 0,
    progress: bool = False,
) -> Path:
    """The Hugging Face folder `folder` as a committed model-only DCP checkpoint `out` (every
    rank calls it; each reads the boxes of the safetensors files its row blocks need)."""
    expected = adapter.from_hf(SafetensorsFolder(folder).meta_tensors())  # names and shapes
    cast = DTYPES[dtype] if dtype else None
    shapes: Shapes = {
        name: (tuple(t.shape), cast if cast is not None and t.is_floating_point() else t.dtype)
        for name, t in expected.items()
    }
    state = empty_shards(shapes, world_mesh())
    load_hf_weights(state, adapter, folder, progress=progress)
    return save_model_checkpoint(state, out, step=step)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
