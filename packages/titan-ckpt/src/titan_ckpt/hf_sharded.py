"""Hugging Face weights into and out of a sharded model, each rank touching its own shards.

`load_hf_weights` fills every rank's local shards (FSDP, TP, EP, HSDP, pipeline stages: any
DTensor layout, and plain tensors) with the boxes of the safetensors files they need, read
one tensor at a time; `save_hf_weights` writes a folder `from_pretrained` loads (the files,
`model.safetensors.index.json`, `config.json`) from each rank's local shards, each rank
writing its own bytes in place. No rank gathers a tensor, let alone the model: a rank holds
its shards plus the box it is converting, whose size is that of its shard of one tensor (a
little more for a box that cuts attention heads, which reads the whole heads).

Both go through the model's `SlicedHFAdapter` (titan_core.protocols), which says which boxes
of Hugging Face's tensors a box of ours covers, through renames, transposes, per-expert
stacking, joined tensors and Llama's per-head row permutation.

Why not DCP's `HuggingFaceStorageReader`/`Writer` (torch.distributed.checkpoint): they map a
tensor of ours to the tensor of theirs with the same name and shape and reshard DTensors
between the two. Titan's conversions change shapes (experts stacked in ours, one tensor per
expert in theirs; w1 and w3 joined into Llama 4's gate_up) and permute rows within heads, so
a shard of ours is not a shard of any tensor of theirs; going through DCP would mean whole
tensors before converting. The writer would also write each rank's pieces to files of their
own and merge them afterwards, writing everything twice.

Every rank calls these (collectives: a few object gathers and barriers); a problem any rank
finds is raised on every rank, so no rank is left waiting. An adapter that converts whole
state dicts only (a plain `HFAdapter`) still works, the way it must: every rank reads the
whole checkpoint, and the export gathers the whole model on every rank.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from tqdm import tqdm

from titan_ckpt.errors import CheckpointLoadError, CheckpointSaveError
from titan_ckpt.hf import export_hf, import_hf
from titan_ckpt.hf_files import (
    DTYPES,
    INDEX_FILE,
    BoxWriter,
    SafetensorsFolder,
    create_files,
    plan_files,
)
from titan_ckpt.states import ModelState
from titan_core.log import get_logger
from titan_core.protocols import Box, HFAdapter, SlicedHFAdapter, is_sliced_hf_adapter

log = get_logger("ckpt")


Weights = nn.Module | Sequence[nn.Module] | Mapping[str, torch.Tensor]
"""A model, a rank's pipeline-stage modules, or a state dict of tensors (DTensors or plain)
whose storage is filled or written in place."""


def load_hf_weights(
    model: Weights,
    adapter: SlicedHFAdapter | HFAdapter,
    in_dir: str | Path,
    *,
    progress: bool = False,
) -> None:
    """Fill the model's parameters and saved buffers in place from an HF safetensors folder.

    `model` is a module or a rank's pipeline-stage modules, materialised (`to_empty`) and
    parallelised in any way, or a state dict of such tensors; names are those of the unsplit
    model. Before anything is read,
    the checkpoint is checked against the model on every rank (every name there, every shape
    as the model has it, nothing the adapter cannot convert): CheckpointLoadError names what
    is wrong."""
    if not is_sliced_hf_adapter(adapter):
        _note_whole(adapter)
        full = import_hf(in_dir, adapter, progress=progress)
        if not isinstance(model, Mapping):
            ModelState(model).load_full_state_dict(full)
            return
        with torch.no_grad():
            for name, value in model.items():
                local, index = _local_box(value)
                local.copy_(full[name][index])
        return
    folder = SafetensorsFolder(in_dir)
    state = _state(model)
    problems = _everyone(_mismatches(adapter, folder, state))
    if problems:
        raise CheckpointLoadError(
            f"the Hugging Face weights in {folder.folder} do not fit this model: "
            + "; ".join(problems[:5])
            + (f" and {len(problems) - 5} more" if len(problems) > 5 else "")
            + "\nchoose the model and flavor the checkpoint was saved from"
        )
    errors = []
    with torch.no_grad():
        for name, value in tqdm(state.items(), desc="read HF weights", disable=not progress):
            local, index = _local_box(value)
            if local.numel() == 0:
                continue  # an empty shard (a dimension smaller than its mesh)
            try:
                local.copy_(adapter.from_hf_slice(name, tuple(value.shape), index, folder.read))
            except (OSError, KeyError, ValueError, RuntimeError) as e:
                errors.append(f"{name}: {type(e).__name__}: {e}")
                break
    errors = _everyone(errors)
    if errors:
        raise CheckpointLoadError(f"reading {folder.folder} failed: " + "; ".join(errors[:3]))


def _mismatches(
    adapter: SlicedHFAdapter, folder: SafetensorsFolder, state: dict[str, torch.Tensor]
) -> list[str]:
    """What keeps this rank's tensors from loading: the whole-tensor conversion of the
    checkpoint's names and shapes (meta tensors, no data) gives every name the adapter knows
    and refuses the ones it does not, as a one-process import would."""
    try:
        expected = adapter.from_hf(folder.meta_tensors())
    except (KeyError, ValueError) as e:
        return [str(e).strip("'\"")]
    problems = []
    for name, value in state.items():
        if name not in expected:
            problems.append(f"{name} is not in the checkpoint")
        elif tuple(expected[name].shape) != tuple(value.shape):
            problems.append(
                f"{name} has shape {list(expected[name].shape)} there and {list(value.shape)} in"
                " the model"
            )
    return problems


def save_hf_weights(
    model: Weights,
    adapter: SlicedHFAdapter | HFAdapter,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: bool = False,
    group: dist.ProcessGroup | None = None,
) -> list[Path]:
    """Write the model's weights as an HF safetensors folder from every rank's local shards.

    Floating tensors are cast to `dtype` ("float32", "bfloat16", "float16" or a torch dtype;
    None keeps each one's). Files hold at most `max_shard_bytes` (`model.safetensors`, or
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`), and
    `config.json` is the adapter's. Each tensor's bytes are written once, by the first rank
    holding each box (replicas skip). Returns the files written (the same list on every rank).
    A tensor the adapter refuses (ValueError: a format that cannot hold it) is refused on
    every rank before any file is made. `group`: the process group of its collectives
    (default: the default group; a gloo group of its own lets it run in a background thread
    while training runs its collectives)."""
    token = _GROUP.set(group)
    try:
        return _save_hf_weights(model, adapter, out_dir, dtype, max_shard_bytes, progress)
    finally:
        _GROUP.reset(token)


def _save_hf_weights(model, adapter, out_dir, dtype, max_shard_bytes, progress) -> list[Path]:
    out = Path(out_dir)
    if not is_sliced_hf_adapter(adapter):
        _note_whole(adapter)
        full = _full_state(model)  # a collective: every rank takes part
        written = []
        if _rank() == 0:
            written = export_hf(full, adapter, out, dtype=dtype, max_shard_bytes=max_shard_bytes,
                                progress=progress)  # fmt: skip
        del full
        _barrier()
        return written
    cast = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = dict(adapter.hf_config())  # refuses an unrepresentable model, alike on every rank
    staged = model if isinstance(model, StagedWeights) else stage_hf_weights(model, copy=False)
    writers = staged.writers

    # Which tensors the folder holds: each rank reports the ones whose first element it writes.
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    refused = []
    for name in writers:
        local, index, shape = staged.boxes[name]
        try:
            slices = adapter.to_hf_slices(name, shape, index, local)
        except (KeyError, ValueError) as e:
            refused.append(str(e).strip("'\""))
            continue
        for hf, piece in slices:
            if all(s.start == 0 for s in hf.index):
                found[hf.name] = (hf.shape, _out_dtype(piece.dtype, cast))
    refused = _everyone(refused)
    if refused:
        raise ValueError("; ".join(refused[:3]))
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for part in _everyone_dicts(found):
        tensors |= part
    plan = plan_files(tensors, max_shard_bytes)

    if _rank() == 0:
        create_files(out, plan)
        float_dtypes = {d for _, d in tensors.values() if d.is_floating_point}
        if len(float_dtypes) == 1:
            config["torch_dtype"] = str(float_dtypes.pop()).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2))
    _barrier()

    errors = []
    writer = BoxWriter(out, plan)
    try:
        for name in tqdm(writers, desc="write HF weights", disable=not progress):
            local, index, shape = staged.boxes[name]
            if local.numel() == 0:
                continue
            for hf, piece in adapter.to_hf_slices(name, shape, index, local):
                writer.write(hf, piece)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        writer.close()
    errors = _everyone(errors)  # also the barrier after which every file is complete
    if errors:
        if _rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
        raise CheckpointSaveError(f"writing Hugging Face weights to {out} failed: {errors[0]}")
    index = [out / INDEX_FILE] if len(plan.files) > 1 else []
    return [out / f for f in plan.files] + index + [out / "config.json"]


@dataclass
class StagedWeights:
    """The boxes of the weights this rank writes into a Hugging Face folder (`save_hf_weights`
    takes it in place of the model): name -> (its local part, where that lies in the full
    tensor, the full shape), in the order they are written."""

    boxes: dict[str, tuple[torch.Tensor, Box, tuple[int, ...]]]

    @property
    def writers(self) -> list[str]:
        return list(self.boxes)


def stage_hf_weights(model: Weights, *, copy: bool = True) -> StagedWeights:
    """The part of the model's weights this rank writes (`save_hf_weights`), as CPU copies
    with `copy`: the model may train on while they are written in the background. A
    collective (which rank writes a box held by several)."""
    state = _state(model)
    boxes = {}
    for name in _writers(state):
        local, index = _local_box(state[name])
        if copy:
            local = local.detach().to("cpu", copy=True)
        boxes[name] = (local, index, tuple(state[name].shape))
    return StagedWeights(boxes)


def _note_whole(adapter: object) -> None:
    if _rank() == 0:
        log.warning(
            "%s converts whole state dicts only (it has no to_hf_slices/from_hf_slice): every"
            " rank holds the whole model while its Hugging Face weights are read or written",
            type(adapter).__name__,
        )


def _state(model: Weights) -> dict[str, torch.Tensor]:
    """The state dict whose tensors (DTensors or plain) share the model's storage."""
    return dict(model) if isinstance(model, Mapping) else ModelState(model).state_dict()


def _full_state(model: Weights) -> dict[str, torch.Tensor]:
    if not isinstance(model, Mapping):
        return ModelState(model).full_state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.items()}


def _out_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None and dtype.is_floating_point else dtype


def _local_box(value: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """This rank's part of a state-dict entry (the storage the model uses) and where it lies
    in the full tensor."""
    if not isinstance(value, DTensor):
        return value, tuple(slice(0, n) for n in value.shape)
    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    local = value.to_local()
    if tuple(local.shape) != tuple(shape):
        raise ValueError(
            f"a DTensor of shape {list(value.shape)} placed {value.placements} holds a local"
            f" tensor of shape {list(local.shape)}, not the {list(shape)} its placements give"
        )
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _writers(state: dict[str, torch.Tensor]) -> list[str]:
    """The entries whose local box this rank writes: of the ranks that hold the same box (a
    DTensor's replicas, a plain tensor every data-parallel rank holds), the first."""
    mine = []
    plain = []
    for name, value in state.items():
        if isinstance(value, DTensor):
            coordinate = value.device_mesh.get_coordinate() or []
            replicas = [c for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate)]
            if all(c == 0 for c in replicas):
                mine.append(name)
        else:
            plain.append(name)
    if plain and _world() > 1:
        holders: list[list[str] | None] = [None] * _world()
        dist.all_gather_object(holders, plain, group=_GROUP.get())
        first: dict[str, int] = {}
        for rank, names in enumerate(holders):
            for name in names or []:
                first.setdefault(name, rank)
        plain = [name for name in plain if first[name] == _rank()]
    return mine + plain


# ----------------------------------------------------------------------------- collectives


_GROUP: ContextVar[dist.ProcessGroup | None] = ContextVar("hf_sharded_group", default=None)
"""The process group of the collectives of the save in progress (None: the default group)."""


def _world() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(_GROUP.get())


def _rank() -> int:
    return dist.get_rank() if _world() > 1 else 0


def _barrier() -> None:
    if _world() > 1:
        dist.barrier(group=_GROUP.get())


def _everyone(local: list[str]) -> list[str]:
    """Every rank's list, joined without repeats (the same on every rank)."""
    if _world() == 1:
        return local
    parts: list[list[str] | None] = [None] * _world()
    dist.all_gather_object(parts, local, group=_GROUP.get())
    merged: list[str] = []
    for part in parts:
        merged += [item for item in part or [] if item not in merged]
    return merged


def _everyone_dicts(local: dict) -> list[dict]:
    if _world() == 1:
        return [local]
    parts: list[dict | None] = [None] * _world()
    dist.all_gather_object(parts, local, group=_GROUP.get())
    return [part or {} for part in parts]
