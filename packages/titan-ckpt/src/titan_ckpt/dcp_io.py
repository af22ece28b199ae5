"""Reading and writing DCP folders outside a training job: safe loading, consolidation to one
process, and writing a plain state dict as a committed checkpoint."""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Iterator, Mapping
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
from titan_ckpt.integrity import (
    checked_while_read,
    checksumming_writer,
    entry_problem,
    nonfinite_entries,
    verify_files,
)
from titan_ckpt.safe_read import load_plain, read_metadata_file, safe_reader
from titan_ckpt.storage import RemotePath, as_path

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
    return dict(read_metadata_file(as_path(path) / ".metadata").state_dict_metadata)


def checkpoint_problems(
    path: str | Path, rank: int = 0, world: int = 1, *, read_data: bool = True
) -> list[str]:
    """Why the checkpoint folder `path` cannot be trusted, or an empty list: a commit marker
    that cannot be read, names another step than its folder, or records no checksum for a file
    the checkpoint holds; no `.metadata`, or one that asks to run code; a file whose size or
    checksum differs from what the marker recorded (cut short, overwritten, replaced).

    With `read_data` (the default) every byte is read once. Without it, data files with
    piecewise checksums are only checked for their size, because a load checks their bytes as
    it reads them (SafeFileSystemReader with the marker's checksums). With `rank` and `world`,
    this process checks only its share of the data files (the marker and `.metadata` are
    checked by all); merge the ranks' lists. `path` may be a URL."""
    path = as_path(path)
    try:
        record = layout.read_commit(path)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return [f"its commit marker {layout.COMMIT_FILE} cannot be read ({reason})"]
    problem = layout.step_problem(path, record)
    if problem:
        return [problem]
    if not (path / ".metadata").is_file():
        return ["it has no .metadata (DCP's index of the saved tensors)"]
    files = record.get("files")
    if files is None:  # titan-ckpt 0.1.0 wrote none: nothing to compare (the caller says so)
        return _metadata_problems(path)
    problem = _marker_form_problem(files)
    if problem:
        return [problem]
    problems = verify_files(path, {".metadata": files[".metadata"]})
    if problems:
        return problems
    metadata, problems = _read_metadata(path)
    if problems:
        return problems
    held = {p.name for p in path.glob("*.distcp")} | {
        info.relative_path
        for info in (metadata.storage_data or {}).values()
        if hasattr(info, "relative_path")  # the files `.metadata` says hold the saved items
    }
    unrecorded = sorted(held - set(files))
    if unrecorded:
        return [_unrecorded(unrecorded)]
    data = {name: entry for name, entry in files.items() if name != ".metadata"}
    return verify_files(path, data, rank, world, read=read_data)


def _marker_form_problem(files: Any) -> str | None:
    form = (
        f"its commit marker {layout.COMMIT_FILE} lists checksums in a form this version cannot read"
    )
    if not isinstance(files, Mapping):
        return f"{form} ('files' is a {type(files).__name__}, not a table)"
    for name, entry in sorted(files.items()):
        problem = entry_problem(entry)
        if problem:
            return f"{form} ({name}: {problem})"
    if ".metadata" not in files:
        return _unrecorded([".metadata"])
    return None


def _unrecorded(names: list[str]) -> str:
    return (
        f"its commit marker records no checksum for {', '.join(names[:3])}"
        + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        + ", which the checkpoint holds: the marker was damaged, edited or written by another"
        f" tool, so the checkpoint cannot be verified (restore its {layout.COMMIT_FILE} from a"
        " copy, or move the folder away)"
    )


def _metadata_problems(path: Path) -> list[str]:
    return _read_metadata(path)[1]


def _read_metadata(path: Path) -> tuple[Any, list[str]]:
    """`.metadata` read without running code, or why it cannot be."""
    try:
        return read_metadata_file(path / ".metadata"), []
    except Exception as e:  # noqa: BLE001 - any failure to read it is the problem
        return None, [str(e) if str(e) else type(e).__name__]


def checksums_to_check_while_reading(path: str | Path) -> dict[str, Any] | None:
    """The marker's checksum entries when a load can check the bytes it reads against them
    (piecewise sums); None for markers without them."""
    files = layout.read_commit(path).get("files")
    if isinstance(files, Mapping) and any(
        isinstance(e, Mapping) and checked_while_read(e) for e in files.values()
    ):
        return dict(files)
    return None


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


SECOND_MOMENTS = frozenset(
    {
        "exp_avg_sq",  # Adam, AdamW, Ranger21
        "max_exp_avg_sq",  # AMSGrad
        "exp_avg_sq_row",  # Adafactor's factors
        "exp_avg_sq_col",
        "square_avg",  # RMSprop, Adadelta
        "acc_delta",  # Adadelta
        "sum",  # Adagrad
        "grad_sum_sq",  # MADGRAD
        "exp_inf",  # Adamax
    }
)
"""Optimizer states that average or sum squares (or magnitudes): never negative."""


def value_problems(path: str | Path, *, progress: bool = True) -> list[str]:
    """Saved values that cannot be right, read a chunk at a time in one process: NaN or inf in
    the model or optimizer, a negative second-moment estimate (`SECOND_MOMENTS`), an optimizer
    step count that is not a whole number from 0 to the checkpoint's step (an optimizer takes
    at most one step per training step)."""
    path = as_path(path)
    problems = [
        f"{name} holds NaN or inf"
        for name in nonfinite_tensors(path, ("model.",), progress=progress)
    ]
    keys = checkpoint_keys(path)
    if not any(
        k.startswith("optimizer.") and isinstance(v, TensorStorageMetadata) for k, v in keys.items()
    ):
        return problems
    try:
        saved_step = int(layout.read_commit(path)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        saved_step = None
    for chunk in _chunks(path, "optimizer.", progress=progress, chunk_bytes=1 << 28):
        problems += [f"{name} holds NaN or inf" for name in nonfinite_entries(chunk)]
        for key, tensor in chunk.items():
            kind = key.rsplit(".", 1)[-1]
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if kind in SECOND_MOMENTS and bool((tensor < 0).any()):
                problems.append(
                    f"{key} holds negative values (down to {tensor.min().item():.3g}), which a"
                    " second-moment estimate never does"
                )
            elif kind == "step":
                problems += _step_problems(key, tensor, saved_step)
    return problems


def _step_problems(key: str, tensor: torch.Tensor, saved_step: int | None) -> list[str]:
    values = tensor.double().flatten()
    if not bool(torch.isfinite(values).all()):
        return []  # reported as NaN or inf
    if bool((values != values.round()).any()) or bool((values < 0).any()):
        return [f"{key} = {values[0].item():g} is not a whole number of steps"]
    top = int(values.max().item())
    if saved_step is not None and top > saved_step:
        return [
            f"{key} = {top:,} counts more optimizer steps than the checkpoint's step {saved_step:,}"
            " (one per training step at most; expected only if the run reset its step count with"
            ' exclude_from_loading = ["train_state"])'
        ]
    return []


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
    reader = safe_reader(path)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"read {as_path(path).name}",
        disable=not progress,
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
    """Write `state_dict` as a committed, model-only checkpoint folder `path` (a local folder or
    a URL): by one process, or, when a process group is up, by every rank (a collective), each
    writing its own shards of the DTensors, rank 0 committing."""
    final = as_path(path)
    group = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if group else 1
    first = not group or dist.get_rank() == 0
    if isinstance(final, RemotePath):  # no rename: written in place, committed by its marker
        tmp = final
        if first:
            layout.discard(final)
        if group:
            dist.barrier()  # nothing of an older save left before any rank writes
    else:
        tmp = final.with_name(final.name + ".tmp")
        final.parent.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": state_dict}, storage_writer=checksumming_writer(tmp), no_dist=not group)
    if group:
        dist.barrier()  # every rank's files and checksums are written
    if first:
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
        storage_reader=safe_reader(path),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return {k[len(prefix) :]: v for k, v in wanted.items()}
