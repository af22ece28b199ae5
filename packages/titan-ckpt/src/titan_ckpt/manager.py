"""CheckpointManager: saves and restores the whole training state with DCP.

One `step-<N>` folder per save holds the model and optimizer (sharded DTensors keep their global
layout and reshard on load), the LR scheduler, each data-parallel rank's loader position, the
train state, each rank's RNG states and the resolved config. See `layout.py` for how a save
becomes visible only once complete, and `integrity.py` for what is checked before a save is
written (no NaN or inf) and before one is loaded (every file's checksum, metadata that cannot
run code). A checkpoint that fails its checks is reported by name and the previous one is used.
`folder` may be a URL (`s3://bucket/run`, any fsspec storage: see storage.py).
"""

from __future__ import annotations

import errno
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titan_ckpt import hf_snapshots, layout
from titan_ckpt.config import Checkpoint
from titan_ckpt.dcp_io import (
    SafeLoadPlanner,
    checkpoint_keys,
    checkpoint_problems,
    checksums_to_check_while_reading,
)
from titan_ckpt.errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    corrupt_data,
    failure_reason,
    first_line,
    os_error,
    state_mismatch,
)
from titan_ckpt.hf import DTYPES, export_hf
from titan_ckpt.hf_sharded import (
    StagedWeights,
    load_hf_weights,
    save_hf_weights,
    stage_hf_weights,
)
from titan_ckpt.integrity import checksumming_writer, nonfinite_entries
from titan_ckpt.preflight import size_text
from titan_ckpt.safe_read import safe_reader
from titan_ckpt.staging import build_stager
from titan_ckpt.states import BlobState, ModelState, OptimizerState, RNGState, TextState
from titan_ckpt.storage import RemotePath, as_path, check_remote_writable, is_url
from titan_core.distributed import any_rank
from titan_core.log import get_logger
from titan_core.protocols import GLOBAL_STATE, HFAdapter, is_sliced_hf_adapter
from titan_core.run_folder import FolderLock, RunFolderError, check_writable

log = get_logger("ckpt")


@dataclass
class _Pending:
    """An async save whose files are still being written."""

    step: int
    tmp: Path
    record: dict[str, Any]
    upload: Future
    staging: Future | None


@dataclass
class _HFPending:
    """A Hugging Face snapshot being written in the background."""

    step: int
    tmp: Path
    done: Future


class CheckpointManager:
    """Saves `states` every `config.interval` steps into `folder` and restores them.

    `states` maps names to objects: "model" (an nn.Module or a list of pipeline-stage modules),
    "optimizer" (a torch optimizer over the model's parameters), and any other `Stateful`
    (lr_scheduler, train_state, ...). "dataloader" is stored per data-parallel rank under
    `dataloader.dp<rank>`, and not restored when the data-parallel degree changed; a loader
    state that is global (`titan_core.GLOBAL_STATE`: the same on every rank, any layout
    resumes from it) is stored once, as `dataloader.state`, and restored on any degree. RNG
    states are added as `rng.rank<rank>`.

    Works in one plain process (no process group) and in any torch.distributed job; every rank
    calls every method. A manager that saves (`enable` or `create_seed_checkpoint`) checks at
    once that `folder` is writable and claims it for this run (`titan_core.FolderLock`); a
    second run on the same folder is refused until `close()`. `folder` may be a URL: it is
    write-tested with a small object, and not locked (object stores have no locks).

    With `[checkpoint] hf_interval`, Hugging Face snapshots are written into `<folder>/hf`
    (see hf_snapshots.py); `hf_extra_files(folder)` is called on rank 0 with each snapshot's
    local folder to add files the manager cannot make itself (the trainer writes its
    tokenizer's files there: titan-ckpt knows no tokenizers).
    """

    def __init__(
        self,
        config: Checkpoint,
        states: Mapping[str, Any],
        folder: str | Path,
        *,
        config_toml: str = "",
        dp_rank: int = 0,
        dp_world_size: int = 1,
        hf_adapter: HFAdapter | None = None,
        hf_extra_files: Callable[[Path], Any] | None = None,
    ):
        problems = config.validate()
        if problems:
            raise ValueError("\n".join(problems))
        self.config = config
        self.folder = as_path(folder)
        self.config_toml = config_toml
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.hf_adapter = hf_adapter
        self.hf_extra_files = hf_extra_files
        if config.hf_interval > 0 and hf_adapter is None:
            raise ValueError(
                "[checkpoint] hf_interval needs the model's HF adapter; this model has none\n"
                "set hf_interval = 0"
            )
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        self.states = self._wrap(states)
        if "model" in self.states:
            self.states["model"].snapshot_buffers = config.async_mode != "disabled"
        self._model_parts = states.get("model")
        self._pending: _Pending | None = None
        self._loaded_path: Path | None = None
        self._stager = None
        self._async_pg = None
        self._staging_hook = None
        self._lock: FolderLock | None = None
        if config.enable or config.create_seed_checkpoint:
            self._claim_folder()
        if config.async_mode != "disabled":
            self._setup_async(states.get("optimizer"))
        self._hf_pending: _HFPending | None = None
        self._hf_threads: ThreadPoolExecutor | None = None
        self._hf_pg = None
        if config.hf_interval > 0 and config.async_mode != "disabled" and self.world_size > 1:
            # Snapshots written in the background run their collectives beside the training's
            # and the async DCP save's: a group of their own.
            self._hf_pg = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ set-up
    def _wrap(self, states: Mapping[str, Any]) -> dict[str, Any]:
        wrapped: dict[str, Any] = {}
        for name, obj in states.items():
            if name == "model":
                wrapped[name] = ModelState(obj)
            elif name == "optimizer" and isinstance(obj, torch.optim.Optimizer):
                if "model" not in states:
                    raise ValueError(
                        'states has "optimizer" but no "model"; the optimizer is saved by parameter name'
                    )
                wrapped[name] = OptimizerState(states["model"], obj)
            elif name == "dataloader" and not getattr(obj, GLOBAL_STATE, False):
                wrapped[name] = BlobState(obj, f"dp{self.dp_rank}")
            else:
                if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                    raise TypeError(
                        f"state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict"
                    )
                wrapped[name] = BlobState(obj)
        wrapped["rng"] = BlobState(RNGState(), f"rank{self.rank}")
        return wrapped

    def _claim_folder(self) -> None:
        """Rank 0 checks that the folder can be written and locks it; every rank learns the
        outcome, so that a refusal stops the whole job at start-up."""
        error: RunFolderError | None = None
        if self.rank == 0:
            try:
                self._check_writable(hint="point [checkpoint] folder at another folder")
                if isinstance(self.folder, RemotePath):
                    log.info(
                        "checkpoint folder %s is remote storage: not locked against a second"
                        " run (object stores have no locks); give each run its own folder",
                        self.folder,
                    )
                else:
                    self._lock = FolderLock(
                        self.folder,
                        purpose="checkpoint folder",
                        hint="wait for that run to end, or give this one its own [checkpoint]"
                        " folder (or [job] dump_folder)",
                    )
            except RunFolderError as e:
                error = e
            if self._lock is not None and self._lock.taken_over is not None:
                log.warning(
                    "took over %s from a run that is gone (%s)",
                    self._lock.path,
                    self._lock.taken_over.describe(),
                )
        failed = error is not None
        if self._dist:
            failed = any_rank(failed)
        if failed:
            raise error or RunFolderError(
                f"rank 0 could not claim the checkpoint folder {self.folder} (see its log)"
            )

    def _check_writable(self, hint: str = "") -> None:
        if isinstance(self.folder, RemotePath):
            check_remote_writable(self.folder, purpose="checkpoint folder", hint=hint)
        else:
            check_writable(self.folder, purpose="checkpoint folder", hint=hint)

    def _setup_async(self, optimizer: Any) -> None:
        if self.config.async_executor == "process" and not self._dist:
            raise ValueError(
                '[checkpoint] async_executor = "process" needs an initialised torch.distributed process group\n'
                'use "thread" in a plain single process'
            )
        if self._dist and (self.world_size > 1 or not _has_cpu_backend()):
            # The background writer runs collectives while training runs its own, and DCP's
            # async save refuses a group without a CPU backend (one made as `nccl` alone, as
            # a user's own job may be): give it a gloo group of its own.
            self._async_pg = dist.new_group(backend="gloo")
        has_optimizer = isinstance(optimizer, torch.optim.Optimizer)
        self._stager = build_stager(self.config.async_mode, background=has_optimizer)
        if has_optimizer:
            # The copy may still run when save() returns; parameters must not change before it ends.
            self._staging_hook = optimizer.register_step_pre_hook(
                lambda *_: self.wait_for_staging()
            )

    # ------------------------------------------------------------------ save
    def is_due(self, step: int, last_step: bool = False) -> bool:
        if self.config.create_seed_checkpoint:
            return step == 0
        return last_step or (step > 0 and step % self.config.interval == 0)

    def save(self, step: int, *, last_step: bool = False, force: bool = False) -> None:
        """Save if `step` is due (every `interval` steps, at `last_step`, or step 0 for a seed
        checkpoint), or now with `force` (a preemption: always a full, resumable, synchronous
        save, never model-only and never an HF export). An async save returns after staging;
        its commit happens on a later call. A state holding NaN or inf is never saved: that
        raises CheckpointSaveError and the previous checkpoint stays the newest."""
        self._poll_pending()
        snapshot = not force and self.hf_snapshot_due(step, last_step)
        if not (force or self.is_due(step, last_step)):
            if snapshot:
                self.save_hf_snapshot(step)
            return
        self.wait()
        seed = self.config.create_seed_checkpoint
        final = last_step and not force
        model_only = seed or (final and self.config.last_save_model_only)
        if model_only:
            dtype = None if seed else DTYPES[self.config.export_dtype]
            to_save = {"model": ModelState(self._model_parts, dtype=dtype)}
        else:
            to_save = {**self.states, "config": BlobState(TextState(self.config_toml), "toml")}
        self._refuse_nonfinite(step, model_only)
        record = {
            "step": step,
            "states": sorted(to_save),
            "model_only": model_only,
            "world_size": self.world_size,
            "dp_world_size": self.dp_world_size,
            "finite": True,
        }
        tmp = layout.tmp_dir(self.folder, step)
        if self.rank == 0:
            layout.discard(tmp)  # remains of a crashed attempt at this step
            tmp.mkdir(parents=True)
        self._barrier()
        start = time.perf_counter()
        use_async = (
            self.config.async_mode != "disabled" and not last_step and not seed and not force
        )
        try:
            if use_async:
                self._pending = self._start_async(step, tmp, record, to_save)
            else:
                dcp.save(to_save, storage_writer=checksumming_writer(tmp), no_dist=not self._dist)
                if final and self.config.last_save_in_hf:
                    self._export_hf(to_save, tmp / "hf")
        except BaseException as e:
            self._fail(e, step, tmp)
        if use_async:
            log.info(
                "checkpoint step %d: staged in %.2fs, writing in the background",
                step,
                time.perf_counter() - start,
            )
            if snapshot:  # outside the save's error handling: its own failure is its own
                self.save_hf_snapshot(step)
            return
        self._commit(step, tmp, record)
        self._barrier()
        log.info(
            "checkpoint step %d saved to %s in %.2fs%s",
            step,
            layout.step_dir(self.folder, step),
            time.perf_counter() - start,
            " (forced: a full, resumable save)" if force else "",
        )
        if snapshot:
            self.save_hf_snapshot(step)

    # ------------------------------------------------------------------ Hugging Face snapshots
    def hf_snapshot_due(self, step: int, last_step: bool = False) -> bool:
        """Whether `step` gets a Hugging Face snapshot (every `hf_interval` steps and at the
        last step, when `hf_interval` is on)."""
        every = self.config.hf_interval
        if every <= 0 or self.config.create_seed_checkpoint:
            return False
        return last_step or (step > 0 and step % every == 0)

    def save_hf_snapshot(self, step: int) -> Path:
        """Write the Hugging Face snapshot of `step` into `<folder>/hf/step-<N>` (see
        hf_snapshots.py) and return that folder. Every rank writes its own shards of the
        weights (`export_dtype`); rank 0 adds config.json and `hf_extra_files` (the tokenizer);
        with `hf_save_optimizer` every state but the model goes into its `titan_state/`, a
        DCP checkpoint.

        With an async `async_mode` (and a local folder, and an adapter that converts box by
        box) the weights are written in the background: this returns once each rank has
        copied its own shards to CPU memory (as DCP's async staging copies them), and a
        thread writes the files over a gloo group of its own and commits the snapshot; the
        next snapshot, and `close()`, wait for it first. `titan_state/` is written before
        that, synchronously (a DCP save), and so is the whole snapshot otherwise."""
        self.wait_hf_snapshot()
        start = time.perf_counter()
        final = hf_snapshots.snapshot_dir(self.folder, step)
        tmp = hf_snapshots.tmp_dir(self.folder, step)
        state_dir = tmp / hf_snapshots.TITAN_STATE
        if self.rank == 0:
            hf_snapshots.discard(tmp)  # remains of a crashed attempt at this step
            tmp.mkdir(parents=True)
            if self.config.hf_save_optimizer:
                state_dir.mkdir()
        self._barrier()
        record = {"step": step, "dtype": self.config.export_dtype, "titan_state": False}
        try:
            if self.config.hf_save_optimizer:
                self._save_titan_state(step, state_dir)
                record["titan_state"] = True
            if self._hf_in_background(tmp):
                staged = stage_hf_weights(self._model_parts)
                self._hf_pending = _HFPending(
                    step,
                    tmp,
                    self._hf_executor().submit(
                        self._write_snapshot, step, staged, tmp, final, record, start
                    ),
                )
                log.info(
                    "Hugging Face snapshot step %d: staged in %.2fs, writing in the background",
                    step,
                    time.perf_counter() - start,
                )
                return final
            self._write_snapshot(step, self._model_parts, tmp, final, record, start)
        except BaseException as e:  # raised on every rank: the writes' collectives share it
            self._snapshot_failed(e, step, tmp)
        return final

    def _hf_in_background(self, tmp: Path) -> bool:
        return (
            self.config.async_mode != "disabled"
            and not isinstance(tmp, RemotePath)
            and is_sliced_hf_adapter(self.hf_adapter)
        )

    def _hf_executor(self) -> ThreadPoolExecutor:
        if self._hf_threads is None:
            self._hf_threads = ThreadPoolExecutor(1, thread_name_prefix="titan-hf-snapshot")
        return self._hf_threads

    def _save_titan_state(self, step: int, state_dir: Path) -> None:
        to_save = {name: s for name, s in self.states.items() if name != "model"}
        to_save["config"] = BlobState(TextState(self.config_toml), "toml")
        self._refuse_nonfinite(step, model_only=False)
        dcp.save(to_save, storage_writer=checksumming_writer(state_dir), no_dist=not self._dist)
        if self.rank == 0:
            layout.mark(
                state_dir,
                {
                    "step": step,
                    "states": sorted(to_save),
                    "model_only": False,
                    "world_size": self.world_size,
                    "dp_world_size": self.dp_world_size,
                    "finite": True,
                },
            )

    def _write_snapshot(
        self, step: int, weights: Any, tmp: Path, final: Path, record: dict, start: float
    ) -> None:
        """The weights (from the model, or from the copies `stage_hf_weights` made, in the
        background thread over `_hf_pg`), the extra files, the commit and the pruning."""
        background = isinstance(weights, StagedWeights)
        if background:
            save_hf_weights(
                weights, self.hf_adapter, tmp, dtype=self.config.export_dtype, group=self._hf_pg
            )
        else:
            self._export_hf({}, tmp)
        # Every rank's files are complete (the write's last step is a collective).
        if self.rank == 0:
            if self.hf_extra_files is not None:
                self._extra_files(tmp)
            hf_snapshots.commit(tmp, final, record)
            keep = self.config.hf_keep_latest_k
            for path in hf_snapshots.prune(self.folder, keep, newest=step):
                log.info("removed old Hugging Face snapshot %s (hf_keep_latest_k = %d)", path, keep)
        if self._dist and self.world_size > 1:
            dist.barrier(group=self._hf_pg if background else None)
        log.info(
            "Hugging Face snapshot step %d written to %s in %.2fs%s",
            step,
            final,
            time.perf_counter() - start,
            " (with the training state)" if record["titan_state"] else "",
        )

    def wait_hf_snapshot(self) -> None:
        """Finish a Hugging Face snapshot written in the background (it commits itself)."""
        pending, self._hf_pending = self._hf_pending, None
        if pending is None:
            return
        try:
            pending.done.result()
        except BaseException as e:
            self._snapshot_failed(e, pending.step, pending.tmp)

    def _snapshot_failed(self, error: BaseException, step: int, tmp: Path) -> None:
        if self.rank == 0:
            hf_snapshots.discard(tmp)
        if isinstance(error, KeyboardInterrupt):
            raise error
        raise CheckpointSaveError(
            f"Hugging Face snapshot at step {step} failed: {first_line(error)}; the previous"
            f" snapshots in {hf_snapshots.snapshots_dir(self.folder)} are untouched\n"
            "fix the cause, or set [checkpoint] hf_interval = 0 to train without snapshots"
        ) from error

    def _extra_files(self, out: Path) -> None:
        """`hf_extra_files` into the snapshot: directly into a local folder, through a local
        temporary folder onto an object store."""
        if not isinstance(out, RemotePath):
            self.hf_extra_files(out)
            return
        with tempfile.TemporaryDirectory(prefix="titan-hf-extra-") as local:
            self.hf_extra_files(Path(local))
            out.fs.put(local + "/", out.path, recursive=True)

    def _refuse_nonfinite(self, step: int, model_only: bool) -> None:
        # The live model and optimizer, not the export-dtype copy a model-only save writes.
        local = []
        if self._model_parts is not None:
            local += nonfinite_entries(ModelState(self._model_parts).state_dict(), "model")
        if not model_only and "optimizer" in self.states:
            local += nonfinite_entries(self.states["optimizer"].state_dict(), "optimizer")
        bad = self._gather(local)
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise CheckpointSaveError(
                f"checkpoint step {step} not saved: {shown} hold NaN or inf; a checkpoint never "
                f"stores non-finite values, so {self._newest_note()} (lower the learning rate, "
                "or check the data)"
            )

    def _start_async(
        self, step: int, tmp: Path, record: dict[str, Any], to_save: dict[str, Any]
    ) -> _Pending:
        kind = (
            AsyncCheckpointerType.PROCESS
            if self.config.async_executor == "process"
            else AsyncCheckpointerType.THREAD
        )
        result = dcp.async_save(
            to_save,
            storage_writer=checksumming_writer(tmp),
            process_group=self._async_pg,
            async_checkpointer_type=kind,
            async_stager=self._stager,
            no_dist=not self._dist,
        )
        if isinstance(result, Future):
            return _Pending(step, tmp, record, result, None)
        return _Pending(step, tmp, record, result.upload_completion, result.staging_completion)

    def wait_for_staging(self) -> None:
        """Block until an in-flight async save has copied the state (before the next optimizer step)."""
        if self._pending is not None and self._pending.staging is not None:
            self._pending.staging.result()

    def _poll_pending(self) -> None:
        if self._pending is not None and self._pending.upload.done():
            self.wait()

    def wait(self) -> None:
        """Finish an in-flight async save: wait for its files, then commit it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.upload.result()  # DCP's final collective: on return every rank has written
        except BaseException as e:
            self._fail(e, pending.step, pending.tmp)
        self._commit(pending.step, pending.tmp, pending.record)
        log.info("checkpoint step %d committed (async)", pending.step)

    def _commit(self, step: int, tmp: Path, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        final = layout.step_dir(self.folder, step)
        try:
            layout.commit(tmp, final, record, self.config_toml)
        except OSError as e:  # the marker did not fit (a full disk): the save did not happen
            self._fail(e, step, tmp)
        in_flight = {self._pending.tmp} if self._pending is not None else set()
        # The checkpoint this run resumed from stays (it may be an older one asked for by
        # load_step, a point to branch from again); the free-space check counts it.
        protect = {self._loaded_path} if self._loaded_path is not None else set()
        for path in layout.prune(self.folder, self.config.keep_latest_k, protect, newest=step):
            log.info(
                "removed old checkpoint %s (keep_latest_k = %d)", path, self.config.keep_latest_k
            )
        layout.remove_leftovers(self.folder, skip=in_flight)

    def _fail(self, error: BaseException, step: int, tmp: Path) -> None:
        """Report a failed save with its real cause and what to do, give the space back, raise."""
        if isinstance(error, KeyboardInterrupt):
            self._discard(tmp)
            raise error
        cause = os_error(error)
        reason = failure_reason(error)
        if reason is None:
            # DCP's own message may hide the cause ("unexpected pos 704 vs 598"), and errors
            # gathered from other ranks lose their chain: ask the file system directly.
            try:
                self._check_writable()
                reason = first_line(error)
            except RunFolderError as e:
                cause = e.__cause__ if isinstance(e.__cause__, OSError) else None
                reason = (cause.strerror if cause is not None else None) or first_line(error)
        self._discard(tmp)
        raise CheckpointSaveError(
            f"checkpoint save at step {step} failed: {reason}; {self._newest_note()}\n"
            + self._save_advice(cause)
        ) from error

    def _newest_note(self) -> str:
        found = layout.list_checkpoints(self.folder)
        if not found:
            return "there is no earlier checkpoint"
        return f"the previous checkpoint {found[-1][1].name} stays the newest, untouched"

    def _save_advice(self, cause: OSError | None) -> str:
        """What to do about a failed save, for the operating system's reason behind it."""
        found = layout.list_checkpoints(self.folder)
        again = "then run the same command again" + (
            f": it resumes from {found[-1][1].name}" if found else ""
        )
        where = f"the checkpoint folder {self.folder}"
        code = cause.errno if cause is not None else None
        if code in (errno.ENOSPC, errno.EDQUOT):
            size = f" (a checkpoint of this run takes {_size_of(found[-1][1])})" if found else ""
            return (
                f"{where} is on a full disk{size}: free space there, lower [checkpoint]"
                f" keep_latest_k (now {self.config.keep_latest_k}), or point [checkpoint] folder"
                f" at a disk with room; {again}"
            )
        if code == errno.EFBIG:
            return (
                f"{where}: a file size limit stopped the write (`ulimit -f`, or the largest"
                f" file its file system takes): raise it, or point [checkpoint] folder at another"
                f" disk; {again}"
            )
        if code in (errno.EROFS, errno.EACCES, errno.EPERM):
            return (
                f"{where} can no longer be written: make it writable, or point [checkpoint]"
                f" folder elsewhere; {again}"
            )
        return f"{where}: fix the cause above; {again}"

    def _discard(self, tmp: Path) -> None:
        if self.rank == 0:
            layout.discard(tmp)  # free the space a full disk needs back

    def _export_hf(self, to_save: dict[str, Any], out: Path) -> None:
        if self.hf_adapter is None:
            raise ValueError(
                "[checkpoint] last_save_in_hf = true needs the model's HF adapter; this model has none"
            )
        if isinstance(out, RemotePath):
            # An object store takes whole files: rank 0 writes the export to a local folder
            # (the model gathered, a collective) and uploads it.
            full = ModelState(self._model_parts).full_state_dict()
            if self.rank == 0:
                with tempfile.TemporaryDirectory(prefix="titan-hf-") as local:
                    export_hf(
                        full, self.hf_adapter, local, dtype=self.config.export_dtype, progress=False
                    )
                    out.fs.put(local + "/", out.path, recursive=True)
            return
        # Every rank writes its own shards (a collective); no rank gathers the model.
        save_hf_weights(self._model_parts, self.hf_adapter, out, dtype=self.config.export_dtype)

    # ------------------------------------------------------------------ load
    def load(self, step: int = -1) -> int | None:
        """Restore the newest usable checkpoint (or `step`); return its step, or None if there
        is none and no `initial_load_path`. Model-only checkpoints restore the weights only.

        Before anything is read, each candidate's marker, metadata (read without running code)
        and file sizes are checked; its bytes are checked against the marker's checksums while
        they are read. A candidate that fails is reported by name with the reason and the
        previous one is tried. Values read back with NaN or inf also reject a checkpoint.
        CheckpointLoadError when none is usable, or when the `step` asked for is not: it says
        which other checkpoint is."""
        candidates = self._candidates(step)
        if not candidates:
            return self._initial_load()
        failed: list[str] = []
        touched: set[str] = set()
        for path in candidates:
            problem = self._problems(path)
            if problem is None and touched - set(_states_of(path)):
                problem = (
                    f"it lacks {', '.join(sorted(touched - set(_states_of(path))))}, which the "
                    "failed read of a newer checkpoint left half loaded"
                )
            if problem is None:
                try:
                    loaded = self._load_from(path, touched)
                except _Unusable as e:
                    problem = str(e)
                else:
                    if failed:
                        log.warning(
                            "resumed from %s instead of the newest checkpoint, which failed its checks",
                            path.name,
                        )
                    return loaded
            failed.append(f"{path.name}: {problem}")
            log.error("checkpoint %s is not usable: %s", path, problem)
            if step != -1:
                raise CheckpointLoadError(self._asked_step_failed(step, path, problem))
        raise CheckpointLoadError(
            f"no usable checkpoint in {self.folder}; each was left in place:\n  "
            + "\n  ".join(failed)
            + "\nmove the broken ones away (or delete them) to resume from an older one, or to"
            " start afresh; `titan-ckpt verify " + str(self.folder) + "` checks them again"
        )

    def _asked_step_failed(self, step: int, path: Path, problem: str) -> str:
        """`load_step` named a checkpoint that failed: say why, and which one would do."""
        found = [p for _, p in reversed(layout.committed(self.folder)) if p != path]
        usable = None
        for other in found:  # newest first; every byte read: the advice must hold
            if not _model_only(other) and self._problems(other, read_data=True) is None:
                usable = other
                break
        if usable is not None:
            usable_step = layout.read_commit(usable)["step"]
            advice = (
                f"{usable.name} passes every check (all its bytes against their checksums):"
                f" resume from it with [checkpoint] load_step = {usable_step}"
                f" (--checkpoint.load_step {usable_step}), or -1 for the newest usable checkpoint"
            )
        else:
            advice = f"no other checkpoint in {self.folder} passes its checks"
        return (
            f"the checkpoint asked for with [checkpoint] load_step = {step} in {self.folder} is"
            f" not usable:\n  {path.name}: {problem}\n{advice}"
        )

    def _candidates(self, step: int) -> list[Path]:
        """Checkpoints to try, best first: full ones newest first, then model-only ones (a seed
        or final export cannot resume a run). Rank 0's view, so that every rank tries the same."""
        found = layout.committed(self.folder)
        if self.rank == 0:
            for _, path in layout.unmarked(self.folder):
                log.warning(
                    "%s is not loaded: %s",
                    path,
                    layout.UNMARKED.format(marker=layout.COMMIT_FILE),
                )
        if step != -1:
            chosen = [path for s, path in found if s == step]
            if not chosen:
                have = ", ".join(str(s) for s, _ in layout.list_checkpoints(self.folder)) or "none"
                unmarked = [p for s, p in layout.unmarked(self.folder) if s == step]
                why = (
                    f"\n{unmarked[0].name} {layout.UNMARKED.format(marker=layout.COMMIT_FILE)}"
                    if unmarked
                    else ""
                )
                raise CheckpointNotFoundError(
                    f"no complete checkpoint for step {step} in {self.folder} (complete steps:"
                    f" {have}), asked for with [checkpoint] load_step = {step}{why}\nset"
                    " load_step to one of those steps, or -1 for the newest usable checkpoint"
                )
        else:
            full = [path for _, path in reversed(found) if not _model_only(path)]
            chosen = full + [path for _, path in reversed(found) if _model_only(path)]
        if self._dist and self.world_size > 1:
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        if chosen and step == -1:
            log.info("resuming from the newest complete checkpoint: %s", chosen[0])
        return chosen

    def _problems(self, path: Path, *, read_data: bool = False) -> str | None:
        """Why `path` cannot be loaded, or None (see `checkpoint_problems`). The data files'
        bytes are checked while they are read (`_read`), or here with `read_data` (and for
        markers of earlier versions); the files are shared between the ranks, and every rank
        gets the whole answer."""
        local = checkpoint_problems(path, self.rank, self.world_size, read_data=read_data)
        if not local and self.rank == 0 and layout.read_commit(path).get("files") is None:
            log.warning(
                "checkpoint %s records no checksums (saved by titan-ckpt 0.1.0 or another tool): "
                "its files are not verified",
                path,
            )
        problems = self._gather(local)
        return "; ".join(problems) if problems else None

    def _load_from(self, path: Path, touched: set[str]) -> int:
        record = layout.read_commit(path)
        keys = checkpoint_keys(path)
        request, skipped = self._request(keys, record)
        start = time.perf_counter()
        try:
            self._read(request, path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - falls back to an older one
            mismatch = state_mismatch(e)
            if mismatch is not None:  # older checkpoints of this run were saved the same way
                raise CheckpointLoadError(
                    f"checkpoint {path} does not fit this run: {mismatch}\nnothing is wrong"
                    f" with the checkpoints in {self.folder}: they were left in place"
                ) from e
            touched.update(name for name in request if name in ("model", "optimizer"))
            corrupt = corrupt_data(e)
            if corrupt is not None:  # found by the checksums while reading
                raise _Unusable(corrupt) from e
            reason = failure_reason(e) or first_line(e)
            raise _Unusable(f"reading it failed: {reason}") from e
        bad = self._loaded_nonfinite(request)
        if bad:
            touched.update(name for name in request if name in ("model", "optimizer"))
            raise _Unusable(f"it holds NaN or inf in {', '.join(bad[:5])}")
        self._loaded_path = path
        note = f"; not restored: {', '.join(skipped)}" if skipped else ""
        log.info(
            "loaded checkpoint %s (step %d) in %.2fs%s",
            path,
            record["step"],
            time.perf_counter() - start,
            note,
        )
        return int(record["step"])

    def _loaded_nonfinite(self, request: dict[str, Any]) -> list[str]:
        local = []
        for name in ("model", "optimizer"):
            if name in request:
                local += nonfinite_entries(self.states[name].state_dict(), name)
        return self._gather(local)

    def _request(
        self, keys: Mapping[str, Any], record: Mapping[str, Any]
    ) -> tuple[dict[str, Any], list[str]]:
        excluded = set(self.config.exclude_from_loading)
        request, skipped = {}, []
        for name, state in self.states.items():
            prefix = name + "."
            if name in excluded:
                skipped.append(f"{name} (exclude_from_loading)")
                continue
            if not any(k.startswith(prefix) for k in keys):
                skipped.append(f"{name} (not in checkpoint)")
                continue
            global_state = getattr(getattr(state, "inner", None), GLOBAL_STATE, False)
            if (
                name == "dataloader"
                and not global_state
                and record.get("dp_world_size") != self.dp_world_size
            ):
                (log.warning if self.rank == 0 else log.debug)(
                    "checkpoint was saved with %s data-parallel ranks, this job has %d: data loaders are not "
                    "restored and start from the beginning of their shards (set exclude_from_loading = "
                    '["dataloader"] to silence this)',
                    record.get("dp_world_size"),
                    self.dp_world_size,
                )
                skipped.append("dataloader (data-parallel size changed)")
                continue
            if isinstance(state, BlobState):
                meta = keys.get(f"{prefix}{state.key}")
                if meta is None:
                    skipped.append(f"{name} (no entry for {state.key})")
                    continue
                state.load_size = meta.size.numel()
            request[name] = state
        return request, skipped

    def _read(self, request: dict[str, Any], path: Path) -> None:
        try:
            dcp.load(
                request,
                storage_reader=safe_reader(path, checksums_to_check_while_reading(path)),
                planner=SafeLoadPlanner(),
                no_dist=not self._dist,
            )
        finally:  # a failed load must not leave blobs in "load" mode for the next save
            for state in self.states.values():
                if isinstance(state, BlobState):
                    state.load_size = None

    def _initial_load(self) -> int | None:
        cfg = self.config
        if not cfg.initial_load_path:
            log.info("no checkpoint in %s: starting from scratch", self.folder)
            return None
        path = as_path(cfg.initial_load_path)
        if cfg.initial_load_in_hf and is_url(path):
            raise ValueError(
                f"[checkpoint] initial_load_path = {str(path)!r}: Hugging Face weights are read"
                " from a local folder; download them first (titan-download, or the store's"
                " own copy command) and name that folder"
            )
        if cfg.initial_load_in_hf:
            if self.hf_adapter is None:
                raise ValueError(
                    "[checkpoint] initial_load_in_hf = true needs the model's HF adapter; this model has none"
                )
            # Every rank reads the parts of the files its own shards need.
            load_hf_weights(self._model_parts, self.hf_adapter, path, progress=self.rank == 0)
            log.info("initialised the model from Hugging Face weights in %s", path)
            if cfg.initial_load_model_only:
                return 0
            return self._load_titan_state(path)
        if not layout.is_complete(path):
            raise CheckpointNotFoundError(
                f"[checkpoint] initial_load_path = {str(path)!r} is not a complete checkpoint"
                f" folder (one holding {layout.COMMIT_FILE} and .metadata)\npoint it at a"
                " step-<N> folder of a run, or at the output of `titan-ckpt convert hf-to-dcp`"
            )
        problem = self._problems(path)
        if problem is not None:
            raise CheckpointLoadError(
                f"[checkpoint] initial_load_path = {str(path)!r} is not usable: {problem}"
            )
        keys = checkpoint_keys(path)
        record = layout.read_commit(path)
        request, _ = self._request(keys, record)
        if cfg.initial_load_model_only:
            request = {"model": request["model"]}
        try:
            self._read(request, path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported with the path
            reason = corrupt_data(e) or failure_reason(e) or first_line(e)
            raise CheckpointLoadError(
                f"[checkpoint] initial_load_path = {str(path)!r} is not usable: {reason}"
            ) from e
        bad = self._loaded_nonfinite(request)
        if bad:
            raise CheckpointLoadError(
                f"[checkpoint] initial_load_path = {str(path)!r} holds NaN or inf in {', '.join(bad[:5])}"
            )
        log.info("initialised from %s (%s)", path, ", ".join(sorted(request)))
        return 0

    def _load_titan_state(self, snapshot: Path) -> int:
        """Everything but the weights from a Hugging Face snapshot's `titan_state/` (saved with
        `hf_save_optimizer`); returns its step."""
        path = snapshot / hf_snapshots.TITAN_STATE
        where = f"[checkpoint] initial_load_path = {str(snapshot)!r}"
        if not layout.is_complete(path):
            raise CheckpointNotFoundError(
                f"{where} with initial_load_model_only = false needs the training state beside"
                f" the weights ({hf_snapshots.TITAN_STATE}/, saved with [checkpoint]"
                " hf_save_optimizer = true), and this folder has none\nset"
                " initial_load_model_only = true to start from the weights alone"
            )
        problem = self._problems(path)
        if problem is not None:
            raise CheckpointLoadError(f"{where} is not usable: {problem}")
        record = layout.read_commit(path)
        request, skipped = self._request(checkpoint_keys(path), record)
        request.pop("model", None)
        try:
            self._read(request, path)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported with the path
            reason = state_mismatch(e) or corrupt_data(e) or failure_reason(e) or first_line(e)
            raise CheckpointLoadError(f"{where} is not usable: {reason}") from e
        bad = self._loaded_nonfinite(request)
        if bad:
            raise CheckpointLoadError(f"{where} holds NaN or inf in {', '.join(bad[:5])}")
        note = f"; not restored: {', '.join(skipped)}" if skipped else ""
        log.info(
            "resumed from the Hugging Face snapshot %s (step %d: weights, %s)%s",
            snapshot,
            record["step"],
            ", ".join(sorted(request)),
            note,
        )
        return int(record["step"])

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Finish and commit an in-flight save, release the stager and hooks, and let go of
        the folder."""
        try:
            self.wait_hf_snapshot()
            self.wait()
            self._barrier()
        finally:
            if self._hf_threads is not None:
                self._hf_threads.shutdown()
                self._hf_threads = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._staging_hook is not None:
                self._staging_hook.remove()
                self._staging_hook = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _barrier(self) -> None:
        if self._dist and self.world_size > 1:
            dist.barrier()

    def _gather(self, local: list[str]) -> list[str]:
        """Every rank's list, concatenated without repeats (a collective in a distributed job)."""
        if not (self._dist and self.world_size > 1):
            return local
        everyone: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(everyone, local)
        merged: list[str] = []
        for items in everyone:
            merged += [item for item in items or [] if item not in merged]
        return merged


def _has_cpu_backend() -> bool:
    """Whether the default process group carries a backend for CPU tensors (gloo beside NCCL,
    `cuda:nccl,cpu:gloo`, as titan-core's `init_distributed` makes it)."""
    group = dist.distributed_c10d._get_default_group()
    return torch.device("cpu") in getattr(group, "_device_types", ())


class _Unusable(Exception):
    """A checkpoint that passed its file checks but could not be restored."""


def _model_only(path: Path) -> bool:
    try:
        return bool(layout.read_commit(path).get("model_only"))
    except (OSError, ValueError):
        return False  # unreadable: tried (and reported) among the full ones


def _states_of(path: Path) -> list[str]:
    return list(layout.read_commit(path).get("states", []))


def _size_of(path: Path) -> str:
    """A checkpoint's size from its marker, in MiB or GiB ("an unknown size" without sums)."""
    size = layout.checkpoint_bytes(path)
    return "an unknown size" if size is None else size_text(size)
