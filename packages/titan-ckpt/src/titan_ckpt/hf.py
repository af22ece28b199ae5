"""Hugging Face interop for whole state dicts: model weights to and from safetensors
folders in one process, through a model's `HFAdapter` (titan_core.protocols), which owns the
name and layout mapping. A sharded model reads and writes its own shards instead
(`hf_sharded`: `load_hf_weights`, `save_hf_weights`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from titan_ckpt.hf_check import INDEX_FILE, SINGLE_FILE, check_safetensors_folder, weight_files
from titan_ckpt.hf_files import DTYPES
from titan_core.protocols import HFAdapter

__all__ = ["DTYPES", "INDEX_FILE", "SINGLE_FILE", "export_hf", "import_hf", "read_safetensors"]


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    adapter: HFAdapter,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = True,
) -> list[Path]:
    """Write a full (unsharded) model state dict as HF safetensors + `config.json`.

    Floating tensors are cast to `dtype` ("float32", "bfloat16", "float16" or a torch dtype).
    Above `max_shard_bytes` the weights are split into `model-0000i-of-0000n.safetensors` with a
    `model.safetensors.index.json`, as `from_pretrained` expects. Returns the files written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    hf_sd = adapter.to_hf(dict(state_dict))
    tensors = {k: _prepare(v, torch_dtype) for k, v in hf_sd.items()}
    shards = _split(tensors, max_shard_bytes)
    written = []
    weight_map = {}
    for i, shard in enumerate(
        tqdm(shards, desc="write safetensors", unit="file", disable=not progress)
    ):
        name = (
            SINGLE_FILE
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(_unshare(shard), str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written.append(out / name)
    if len(shards) > 1:
        total = sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        written.append(out / INDEX_FILE)
    config = dict(adapter.hf_config())
    float_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(float_dtypes) == 1:
        config["torch_dtype"] = str(float_dtypes.pop()).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    written.append(out / "config.json")
    return written


def read_safetensors(in_dir: str | Path, *, progress: bool = True) -> dict[str, torch.Tensor]:
    """All tensors of an HF folder (single file or index + shards), with their HF names."""
    folder = Path(in_dir)
    check_safetensors_folder(folder)  # a damaged file named, not a library error
    files = weight_files(folder)
    out: dict[str, torch.Tensor] = {}
    for name in tqdm(files, desc="read safetensors", unit="file", disable=not progress):
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                out[key] = f.get_tensor(key)
    return out


def import_hf(
    in_dir: str | Path, adapter: HFAdapter, *, progress: bool = True
) -> dict[str, torch.Tensor]:
    """A full model state dict with Titan names, read from an HF safetensors folder."""
    return adapter.from_hf(read_safetensors(in_dir, progress=progress))


def _prepare(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.detach().to("cpu")
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.contiguous()


def _split(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.nbytes
    return shards


def _unshare(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share memory (tied embeddings); give each its own copy.
    seen: set[int] = set()
    out = {}
    for key, t in shard.items():
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out
