"""Checks of a job's checkpoints made offline, before the job starts.

`check_loadable`: will the checkpoint the job resumes from load into its layout? A dry run
knows the global shape of every tensor the job's model will hold (it builds the model at full
size on fake tensors); the checkpoint's `.metadata` records the global shape of every tensor it
holds. DCP reshards between any two layouts, so names and global shapes are all that must agree.

`check_space`: will the job's checkpoints fit on the disk of their folder? The caller counts
the bytes of the saved state from the model's and optimizer's shapes, without memory.

`resume_point`: which checkpoint will the job resume from, and what was it saved with (the
run's config, its data-parallel size)? A trainer checks its own settings against them.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ckpt import layout
from titan_ckpt.config import Checkpoint
from titan_ckpt.dcp_io import checkpoint_keys
from titan_ckpt.hf_check import safetensors_problems
from titan_ckpt.storage import RemotePath, as_path, is_url, join, reach_problem
from titan_core.messages import shortlist
from titan_core.protocols import ResumePoint


def checkpoint_folder(config: Checkpoint, dump_folder: str) -> Path | RemotePath:
    """Where checkpoints of a run with this config and dump folder live: `folder` under the
    dump folder, or `folder` itself when it is absolute or a URL."""
    return as_path(join(dump_folder, config.folder))


def storage_problems(config: Checkpoint, dump_folder: str) -> list[str]:
    """Whether the remote stores a run's checkpoints live in (`folder`, `initial_load_path`)
    answer, asked before anything else reads them: one message each, naming the URL, the
    store's reason and the fixes."""
    problems = []
    if config.enable or config.create_seed_checkpoint or config.initial_load_path:
        folder = checkpoint_folder(config, dump_folder)
        if isinstance(folder, RemotePath):
            problems.append(reach_problem(str(folder), purpose="[checkpoint] folder"))
    if config.initial_load_path and is_url(config.initial_load_path):
        url = str(as_path(config.initial_load_path))
        problems.append(reach_problem(url, purpose="[checkpoint] initial_load_path"))
    return [p for p in problems if p is not None]


def resume_point(config: Checkpoint, dump_folder: str) -> ResumePoint | None:
    """The checkpoint whose state a run with `config` loads (a full one: model-only saves do
    not resume a run): the newest committed one in its folder (`load_step`'s when set), else
    `initial_load_path` when it resumes a whole run (not model-only, not Hugging Face); None
    when there is none. An unreadable commit marker is passed over (the load reports it)."""
    full = []
    for step, path in layout.committed(checkpoint_folder(config, dump_folder)):
        try:
            if not layout.read_commit(path).get("model_only"):
                full.append((step, path))
        except (OSError, ValueError):
            continue
    if config.load_step != -1:
        full = [(s, p) for s, p in full if s == config.load_step]
    if full:
        return _resume_point(full[-1][1])
    if config.initial_load_path and not (
        config.initial_load_model_only or config.initial_load_in_hf
    ):
        return _resume_point(as_path(config.initial_load_path))
    return None


def _resume_point(path: Path | RemotePath) -> ResumePoint:
    """What `path` was saved with: its `config.toml` and its marker's data-parallel size."""
    try:
        saved = path / "config.toml"
        config_toml = saved.read_text() if saved.is_file() else None
    except OSError:
        config_toml = None
    try:
        dp = int(layout.read_commit(path).get("dp_world_size") or 1)
    except (OSError, ValueError, TypeError):
        dp = None
    return ResumePoint(str(path), config_toml, dp)


def check_loadable(
    config: Checkpoint, dump_folder: str, expected: Mapping[str, tuple[int, ...]]
) -> tuple[list[str], str]:
    """(problems, note): whether the checkpoint a run would resume from holds every tensor of
    `expected` (model state names -> global shapes) with that shape."""
    folder = checkpoint_folder(config, dump_folder)
    found = layout.list_checkpoints(folder)
    if not found:
        if config.initial_load_path:
            path = as_path(config.initial_load_path)
            if config.initial_load_in_hf:
                return _hf_problems(path), (
                    f"checkpoint: starts from the Hugging Face weights in {path} (their files'"
                    " headers checked; names and shapes when each rank reads its part)"
                )
            if not layout.is_complete(path):
                return [
                    f"[checkpoint] initial_load_path = {str(path)!r} is not a complete checkpoint folder\n"
                    "point it at a step-<N> folder holding titan_commit.json and .metadata"
                ], ""
            return _compare(path, expected), f"checkpoint: starts from {path}"
        return [], f"checkpoint: none in {folder} yet; the run starts from its initialisation"
    resumable = [(s, p) for s, p in found if not layout.read_commit(p).get("model_only")]
    step, path = resumable[-1] if resumable else found[-1]
    problems = _compare(path, expected)
    verdict = "loads into this layout" if not problems else "does NOT load into this layout"
    return problems, f"checkpoint: would resume from {path} (step {step}), which {verdict}"


def _hf_problems(path: Path | RemotePath) -> list[str]:
    """Whether the safetensors files of the HF folder `path` can be read (their headers)."""
    key = f"[checkpoint] initial_load_path = {str(path)!r}"
    if isinstance(path, RemotePath):
        return []  # refused with its own message when the run starts: read from a local copy
    if not path.is_dir():
        return [f"{key} is not a folder\nname the folder of the model's Hugging Face download"]
    problems = safetensors_problems(path)
    if not problems:
        return []
    return [
        f"{key} holds Hugging Face weights that cannot be read:\n  "
        + "\n  ".join(problems)
        + "\ndownload the damaged files again (titan-download, or the hub's own tools), or"
        " point initial_load_path at another copy"
    ]


def _compare(path: Path, expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    try:
        held = checkpoint_keys(path)
    except Exception as e:  # an unreadable metadata file is the finding
        return [f"checkpoint {path} cannot be read: {e}"]
    missing, wrong = [], []
    for name, shape in expected.items():
        meta = held.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            missing.append(name)
        elif tuple(meta.size) != tuple(shape):
            wrong.append(
                f"{name} {tuple(meta.size)} in the checkpoint, {tuple(shape)} in this model"
            )
    problems = []
    if missing:
        problems.append(
            f"checkpoint {path} lacks {len(missing)} tensor(s) of this model:"
            f" {shortlist(missing, 4)}\nis it from another model or flavor? set checkpoint.folder"
            " to a fresh folder, or the matching flavor"
        )
    if wrong:
        problems.append(
            f"checkpoint {path} has other shapes than this model: {shortlist(wrong, 3, '; ')}"
            "\nthe flavor or vocabulary differs; use the flavor and tokenizer the checkpoint was trained with"
        )
    return problems


def check_space(
    config: Checkpoint, dump_folder: str, state_bytes: int, steps: int
) -> tuple[list[str], str]:
    """(problems, note): whether the checkpoints of a run that trains to step `steps` fit on
    the disk of its checkpoint folder, each `state_bytes` (about the model and optimizer state
    saved, which the caller counts from their shapes), or each the size of the newest full
    checkpoint already there when that is more (it holds DCP's metadata and framing too, and
    the other states: it is what the next save writes). The saves and prunes of the run are
    played through (`_most_at_once`): at most keep_latest_k complete ones stay (all with 0),
    plus the one being written, plus the one the run resumed from, which it never prunes;
    the ones there already count as taken, and those that pruning will remove as freed."""
    if not config.enable or state_bytes <= 0:
        return [], ""
    folder = checkpoint_folder(config, dump_folder)
    existing = layout.list_checkpoints(folder)
    resumed = _resumed_step(config, existing)
    saves = _save_steps(config, resumed or 0, steps)
    planned = len(saves[0]) + (saves[1] is not None)
    if planned == 0:
        return [], ""
    state_bytes, what = max((state_bytes, "model and optimizer state"), _measured(existing))
    k = config.keep_latest_k
    held = [s for s, _ in existing]
    most = _most_at_once(held, saves, k, resumed)
    if k == 0:
        kept = "keep_latest_k = 0 keeps every one"
    else:
        kept = f"keep_latest_k = {k} keeps {k}, plus the one being written"
        if most > _most_at_once(held, saves, k, None):
            kept += f", plus step-{resumed}, which this run resumes from and keeps"
    needed = max(1, most - len(existing)) * state_bytes
    if isinstance(folder, RemotePath):  # an object store has no free space to ask about
        return [], (
            f"checkpoint: about {size_text(state_bytes)} each, {planned} to save; {folder} needs"
            f" up to {size_text(needed)} more ({kept}); free space not checked (remote storage)"
        )
    free = shutil.disk_usage(_nearest_existing(folder)).free
    note = (
        f"checkpoint: about {size_text(state_bytes)} each, {planned} to save; {folder} needs up"
        f" to {size_text(needed)} more ({kept}), {size_text(free)} free there"
    )
    if needed <= free:
        return [], note
    return [
        f"[checkpoint] the checkpoints will not fit on the disk of {folder}: each holds about"
        f" {size_text(state_bytes)} ({what}), this run saves {planned} ({kept}), so it needs"
        f" {size_text(needed)} more and the disk has {size_text(free)} free\nfree space there,"
        " lower [checkpoint] keep_latest_k, save less often ([checkpoint] interval), or point"
        " [checkpoint] folder (or [job] dump_folder) at a bigger disk"
    ], note


def _resumed_step(config: Checkpoint, existing: list[tuple[int, Path]]) -> int | None:
    """The step of the checkpoint in the folder a run resumes from (`load_step`, else the
    newest full one, else the newest), or None."""
    if config.load_step != -1:
        return config.load_step if any(s == config.load_step for s, _ in existing) else None
    for step, path in reversed(existing):
        try:
            if not layout.read_commit(path).get("model_only"):
                return step
        except (OSError, ValueError):
            continue
    return existing[-1][0] if existing else None


def _save_steps(config: Checkpoint, start: int, steps: int) -> tuple[range, int | None]:
    """The steps a run from step `start` to `steps` saves at: (every `interval`, the last step
    when it is not one of those). A range, never a list: a run may plan 10^8 saves."""
    due = range((start // config.interval + 1) * config.interval, steps + 1, config.interval)
    return due, (steps if steps > start and steps not in due else None)


def _most_at_once(
    held: list[int], saves: tuple[range, int | None], keep: int, resumed: int | None
) -> int:
    """The most checkpoints on disk at once while `saves` are written beside the `held` ones:
    each save is written, committed, then those beyond the newest `keep` up to it are pruned
    (never `resumed`), as the manager does."""
    due, last = saves
    final = last if last is not None else due[-1]
    if keep == 0:  # nothing is pruned: each new step stays; one written over stays one
        new = len(due) + (last is not None) - sum(1 for s in held if s in due or s == last)
        return len(held) + new + (final in held)
    on_disk, most = set(held), len(held)
    top, past_top = max(held, default=0), 0
    for step in itertools.chain(due, [] if last is None else [last]):
        most = max(most, len(on_disk) + 1)
        on_disk.add(step)
        up_to = sorted(s for s in on_disk if s <= step)
        on_disk -= {s for s in up_to[:-keep] if s != resumed}
        past_top += step > top
        if past_top > keep + 2:  # past every held step: each save adds one and prunes one
            break
    return most


def _measured(existing: list[tuple[int, Path]]) -> tuple[int, str]:
    """(bytes, what they are) of the newest full checkpoint in `existing`, or (0, "")."""
    for _, path in reversed(existing):
        try:
            if layout.read_commit(path).get("model_only"):
                continue
        except (OSError, ValueError):
            continue
        size = layout.checkpoint_bytes(path)
        if size:
            return size, f"the size of {path.name}, the newest there"
    return 0, ""


def size_text(nbytes: float) -> str:
    """A byte count in KiB, MiB, GiB or TiB, one decimal."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 2**10:,.1f} KiB"


def _nearest_existing(path: Path) -> Path:
    """`path` or the nearest of its parents that exists: where the folder will be created."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
