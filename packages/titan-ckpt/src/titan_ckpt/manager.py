"""CheckpointManager: saves and restores the whole training state with DCP.

One `step-<N>` folder per save holds the model and optimizer (sharded DTensors keep their global
layout and reshard on load), the LR scheduler, each data-parallel rank's loader position, the
train state, each rank's RNG states and the resolved config. See `layout.py` for how a save
becomes visible only once complete.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titan_ckpt import layout
from titan_ckpt.config import Checkpoint
from titan_ckpt.dcp_io import SafeLoadPlanner, checkpoint_keys
from titan_ckpt.hf import DTYPES, export_hf, import_hf
from titan_ckpt.staging import build_stager
from titan_ckpt.states import BlobState, ModelState, OptimizerState, RNGState, TextState
from titan_core.log import get_logger
from titan_core.protocols import HFAdapter

log = get_logger("ckpt")


@dataclass
class _Pending:
    """An async save whose files are still being written."""

    step: int
    tmp: Path
    record: dict[str, Any]
    upload: Future
    staging: Future | None


class CheckpointManager:
    """Saves `states` every `config.interval` steps into `folder` and restores them.

    `states` maps names to objects: "model" (an nn.Module or a list of pipeline-stage modules),
    "optimizer" (a torch optimizer over the model's parameters), and any other `Stateful`
    (lr_scheduler, train_state, ...). "dataloader" is stored per data-parallel rank under
    `dataloader.dp<rank>`. RNG states are added as `rng.rank<rank>`.

    Works in one plain process (no process group) and in any torch.distributed job; every rank
    calls every method.
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
    ):
        problems = config.validate()
        if problems:
            raise ValueError("\n".join(problems))
        self.config = config
        self.folder = Path(folder)
        self.config_toml = config_toml
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.hf_adapter = hf_adapter
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
        if config.async_mode != "disabled":
            self._setup_async(states.get("optimizer"))

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
            elif name == "dataloader":
                wrapped[name] = BlobState(obj, f"dp{self.dp_rank}")
            else:
                if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                    raise TypeError(
                        f"state {name!r} ({type(obj).__name__}) has no state_dict/load_state_dict"
                    )
                wrapped[name] = BlobState(obj)
        wrapped["rng"] = BlobState(RNGState(), f"rank{self.rank}")
        return wrapped

    def _setup_async(self, optimizer: Any) -> None:
        if self.config.async_executor == "process" and not self._dist:
            raise ValueError(
                '[checkpoint] async_executor = "process" needs an initialised torch.distributed process group\n'
                'use "thread" in a plain single process'
            )
        if self._dist and self.world_size > 1:
            # The background writer runs collectives while training runs its own: give it a group.
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

    def save(self, step: int, *, last_step: bool = False) -> None:
        """Save if `step` is due (every `interval` steps, at `last_step`, or step 0 for a seed
        checkpoint). An async save returns after staging; its commit happens on a later call."""
        self._poll_pending()
        if not self.is_due(step, last_step):
            return
        self.wait()
        seed = self.config.create_seed_checkpoint
        model_only = seed or (last_step and self.config.last_save_model_only)
        if model_only:
            dtype = None if seed else DTYPES[self.config.export_dtype]
            to_save = {"model": ModelState(self._model_parts, dtype=dtype)}
        else:
            to_save = {**self.states, "config": BlobState(TextState(self.config_toml), "toml")}
        record = {
            "step": step,
            "states": sorted(to_save),
            "model_only": model_only,
            "world_size": self.world_size,
            "dp_world_size": self.dp_world_size,
        }
        tmp = layout.tmp_dir(self.folder, step)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # remains of a crashed attempt at this step
            tmp.mkdir(parents=True)
        self._barrier()
        start = time.perf_counter()
        use_async = self.config.async_mode != "disabled" and not last_step and not seed
        try:
            if use_async:
                self._pending = self._start_async(step, tmp, record, to_save)
                log.info(
                    "checkpoint step %d: staged in %.2fs, writing in the background",
                    step,
                    time.perf_counter() - start,
                )
                return
            dcp.save(to_save, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not self._dist)
            if last_step and self.config.last_save_in_hf:
                self._export_hf(to_save, tmp / "hf")
        except BaseException as e:
            self._discard(tmp)
            _raise_save_error(e, step)
        self._commit(step, tmp, record)
        self._barrier()
        log.info(
            "checkpoint step %d saved to %s in %.2fs",
            step,
            layout.step_dir(self.folder, step),
            time.perf_counter() - start,
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
            storage_writer=dcp.FileSystemWriter(str(tmp)),
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
            self._discard(pending.tmp)
            _raise_save_error(e, pending.step)
        self._commit(pending.step, pending.tmp, pending.record)
        log.info("checkpoint step %d committed (async)", pending.step)

    def _commit(self, step: int, tmp: Path, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        final = layout.step_dir(self.folder, step)
        layout.commit(tmp, final, record, self.config_toml)
        in_flight = {self._pending.tmp} if self._pending is not None else set()
        protect = {self._loaded_path} if self._loaded_path is not None else set()
        for path in layout.prune(self.folder, self.config.keep_latest_k, protect):
            log.info(
                "removed old checkpoint %s (keep_latest_k = %d)", path, self.config.keep_latest_k
            )
        layout.remove_leftovers(self.folder, skip=in_flight)

    def _discard(self, tmp: Path) -> None:
        if self.rank == 0:
            log.error(
                "checkpoint save into %s failed; the previous checkpoint stays the newest", tmp
            )
            shutil.rmtree(tmp, ignore_errors=True)  # free the space a full disk needs back

    def _export_hf(self, to_save: dict[str, Any], out: Path) -> None:
        if self.hf_adapter is None:
            raise ValueError(
                "[checkpoint] last_save_in_hf = true needs the model's HF adapter; this model has none"
            )
        full = ModelState(
            self._model_parts
        ).full_state_dict()  # a collective: every rank takes part
        if self.rank == 0:
            export_hf(full, self.hf_adapter, out, dtype=self.config.export_dtype, progress=False)

    # ------------------------------------------------------------------ load
    def load(self, step: int = -1) -> int | None:
        """Restore the newest complete checkpoint (or `step`); return its step, or None if there is
        none and no `initial_load_path`. Model-only checkpoints restore the weights only."""
        path = self._choose(step)
        if path is None:
            return self._initial_load()
        record = layout.read_commit(path)
        keys = checkpoint_keys(path)
        request, skipped = self._request(keys, record)
        start = time.perf_counter()
        self._read(request, path)
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

    def _choose(self, step: int) -> Path | None:
        found = layout.list_checkpoints(self.folder)
        if step != -1:
            for s, path in found:
                if s == step:
                    return path
            have = ", ".join(str(s) for s, _ in found) or "none"
            raise FileNotFoundError(
                f"no complete checkpoint for step {step} in {self.folder} (complete steps: {have})"
            )
        if not found:
            return None
        resumable = [(s, p) for s, p in found if not layout.read_commit(p).get("model_only")]
        # A model-only save (seed, final export) cannot resume a run: prefer the newest full one.
        newest = resumable[-1] if resumable else found[-1]
        log.info("resuming from the newest complete checkpoint: %s", newest[1])
        return newest[1]

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
            if name == "dataloader" and record.get("dp_world_size") != self.dp_world_size:
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
                storage_reader=dcp.FileSystemReader(str(path)),
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
        path = Path(cfg.initial_load_path)
        if cfg.initial_load_in_hf:
            if self.hf_adapter is None:
                raise ValueError(
                    "[checkpoint] initial_load_in_hf = true needs the model's HF adapter; this model has none"
                )
            ModelState(self._model_parts).load_full_state_dict(
                import_hf(path, self.hf_adapter, progress=self.rank == 0)
            )
            log.info("initialised the model from Hugging Face weights in %s", path)
            return 0
        if not layout.is_complete(path):
            raise FileNotFoundError(
                f"[checkpoint] initial_load_path = {str(path)!r} is not a complete checkpoint folder"
            )
        keys = checkpoint_keys(path)
        record = layout.read_commit(path)
        request, _ = self._request(keys, record)
        if cfg.initial_load_model_only:
            request = {"model": request["model"]}
        self._read(request, path)
        log.info("initialised from %s (%s)", path, ", ".join(sorted(request)))
        return 0

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Finish and commit an in-flight save and release the stager and hooks."""
        self.wait()
        self._barrier()
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._staging_hook is not None:
            self._staging_hook.remove()
            self._staging_hook = None

    def _barrier(self) -> None:
        if self._dist and self.world_size > 1:
            dist.barrier()


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (disk full, I/O error); the previous checkpoint is intact."""


def _raise_save_error(error: BaseException, step: int) -> None:
    # DCP reports write failures as CheckpointException, a BaseException that `except Exception`
    # would miss; turn it into an ordinary error that names the step.
    if isinstance(error, CheckpointException):
        raise CheckpointSaveError(
            f"checkpoint save at step {step} failed; the previous complete checkpoint stays the newest.\n{error}"
        ) from error
    raise error
