"""The training recipe, in the order it runs:

    process group -> layout (mesh, seed, dtype) -> resolved config written -> tokenizer ->
    model on the meta device -> converters -> parallelize -> storage -> data loader ->
    optimizer and schedule -> checkpointer -> weights (from a checkpoint, or the one
    initialisation) -> steps

Every concrete piece (model family, data package, checkpointer, converters) is found by name
through titan-core's plugin registry; this file only composes them. `prepare` builds a `Run`
(everything a run holds, built once); `run_steps` trains it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from titan_core import (
    ConfigError,
    DistInfo,
    MemoryMonitor,
    ParallelDims,
    build_hf_adapter,
    config_to_dict,
    get_logger,
    init_distributed,
    peak_flops,
    plugins,
    resolve,
    resolve_device_type,
    set_seed,
    to_toml,
)
from titan_core.distributed import destroy_distributed
from titan_trainer import memory_check
from titan_trainer.checks import (
    block_causal_device_problem,
    model_args_for,
    optimizer_state_copies,
    parallel_dims_for,
)
from titan_trainer.comm import (
    dump_trace,
    report_collective_failures,
    start_training_timeout,
    torchrun_restarts,
    trace_folder,
)
from titan_trainer.config import JobConfig
from titan_trainer.experts import ExpertLoad
from titan_trainer.fault_tolerance import (
    StepBatches,
    build_replica_group,
    build_semi_sync,
    data_coordinates,
    settle_replica_step,
)
from titan_trainer.guards import (
    StepGuard,
    build_checked_loader,
    claim_run_folders,
    skipped_rows_total,
)
from titan_trainer.loader_state import checkpointed_loader, plugin_kwargs
from titan_trainer.logs import rank_logging
from titan_trainer.loss import cross_entropy_loss
from titan_trainer.lr_schedule import build_lr_scheduler
from titan_trainer.metrics import MetricsLogger, StepTimer
from titan_trainer.optimizer import build_optimizer, current_lr
from titan_trainer.parallel import ParallelRuntime, build_parallel_runtime
from titan_trainer.precision import compute_dtype
from titan_trainer.profiling import maybe_memory_snapshot, maybe_profile
from titan_trainer.validate import Validator

log = get_logger("train")


@dataclass
class TrainState:
    """What the checkpoint needs to know about progress, besides modules and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str = field(default_factory=lambda: new_run_id())
    """Names the run's series of metrics: new for a fresh run, kept (from the checkpoint) by
    its resumes, so that a later run in the same dump folder is never drawn as its sequel."""
    losses: list[float] = field(default_factory=list)
    """Loss per step in this process's lifetime, read back at logging steps (not checkpointed;
    for tests and summaries)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        # Checkpoints written before run ids carry none: their resume starts a series.
        self.run_id = str(state.get("run_id", self.run_id))


def shared_run_id() -> str:
    """A new run id, rank 0's on every rank (any rank's copy may be the one a checkpoint keeps)."""
    import torch.distributed as dist

    run_id = [new_run_id()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(run_id, src=0)
    return run_id[0]


def new_run_id() -> str:
    """`20251123-103511-4f2a`: when the run started, and 16 random bits for runs started in
    the same second."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    losses: list[float]
    stopped_early: bool
    stopped_by: str | None = None
    """What stopped the run before its last step: "SIGTERM" (after saving a checkpoint when
    checkpoints are on) or "SIGINT" (Ctrl-C); None when it finished."""


def build_converters(config: JobConfig, dims: ParallelDims) -> list:
    """The model converters named in `model.converters` (Float8 and friends), each given the
    config section of the same name."""
    return [
        resolve(plugins.CONVERTERS, name)(config_section(config, name), dims)
        for name in config.model.converters
    ]


def build_model(
    config: JobConfig,
    runtime: ParallelRuntime,
    vocab_size: int,
    converters: list,
    stage_io=None,
) -> list[nn.Module]:
    """Meta-device build, converters, parallelism; returns this rank's parts, still on the
    meta device (`runtime.materialize`, then weights from `runtime.init_weights` or a
    checkpoint)."""
    spec = resolve(plugins.MODELS, config.model.name)
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    # The checks refused a block_causal_impl other than auto for a model without the attribute.
    if config.model.attn_mask_type == "block_causal" and hasattr(model, "block_causal_impl"):
        model.block_causal_impl = config.model.block_causal_impl
    for converter in converters:
        converter.convert(model)
    if config.model.print_after_conversion:
        log.info("model after conversion:\n%s", model)
    return runtime.parallelize(model, stage_io)


# ----------------------------------------------------------------------------- the run


@dataclass
class Run:
    """Everything one training run holds, built once by `prepare`."""

    config: JobConfig
    info: DistInfo
    dims: ParallelDims
    runtime: ParallelRuntime
    data: Any
    """The data plugin (`titan_core.DataSpec`)."""
    tokenizer: Any
    loader: Any
    converters: list
    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    state: TrainState
    checkpointer: Any
    """None when no checkpointing is asked for."""
    replicas: Any = None
    """This rank's TorchFT `ReplicaGroup` ([fault_tolerance]), or None."""
    semi_sync: Any = None
    """LocalSGD or DiLoCo over `replicas` ([fault_tolerance] semi_sync_method), or None."""

    @property
    def dump(self) -> str:
        return self.config.job.dump_folder


def train(config: JobConfig) -> TrainResult:
    """Run the job `config` describes on this process (one rank of it under torchrun)."""
    info = init_distributed(
        resolve_device_type(config.job.device),
        config.comm.init_timeout_seconds,
        trace_buf_size=config.comm.trace_buf_size,
        trace_dir=trace_folder(config.job.dump_folder),
    )
    try:
        # Before anything is written: one run per dump folder, and folders that take writes.
        lock = claim_run_folders(config, info.rank)
        if config.comm.trace_buf_size:  # where a timed-out collective's trace goes
            os.makedirs(trace_folder(config.job.dump_folder), exist_ok=True)
        try:
            with rank_logging(config.logging, config.job.dump_folder, info.rank, info.world_size):
                run = prepare(config, info)
                if config.checkpoint.create_seed_checkpoint:
                    return write_seed_checkpoint(run)
                return run_steps(run)
        finally:
            if lock is not None:
                lock.release()
    finally:
        destroy_distributed()


def prepare(config: JobConfig, info: DistInfo) -> Run:
    """Every piece of the run, built in the recipe's order, with its weights in place."""
    dims, dtype, seed = set_up_layout(config, info)
    resolved_toml = write_resolved_config(config, info.rank)
    data = resolve(plugins.DATA, config.training.data_plugin)
    tokenizer = data.build_tokenizer(config.model.tokenizer_source()[0])

    runtime = build_parallel_runtime(config, dims, info.device, dtype, seed, cross_entropy_loss)
    if config.model.attn_mask_type == "block_causal":  # documents start at BOS
        problem = block_causal_device_problem(config, info.device)
        if problem:  # before anything is allocated: never train with a wrong mask
            raise ConfigError(problem)
        runtime.document_start_id = tokenizer.bos_id
    converters = build_converters(config, dims)
    parts = build_model(config, runtime, tokenizer.vocab_size, converters)
    check_memory(config, parts, dims, tokenizer.vocab_size, info.device, runtime.dtype)
    runtime.materialize(parts)

    loader = build_loader(config, data, tokenizer, dims)
    optimizer = build_optimizer(
        parts, config.optimizer, total_steps=config.training.steps, dims=dims
    )
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    state = TrainState(run_id=shared_run_id())
    # Before the checkpoint is loaded: the replica group's step count is part of it.
    replicas = build_replica_group(config, info, parts, optimizer, lr_scheduler, state)
    semi_sync = build_semi_sync(replicas, parts)
    states = {
        "model": parts,
        "optimizer": optimizer,
        "lr_scheduler": lr_scheduler,
        # One global position of the data that any data-parallel degree resumes from; replica
        # groups (their own jobs and checkpoints) keep their own.
        "dataloader": checkpointed_loader(loader, dims.mesh("dp"), per_rank=replicas is not None),
        "train_state": state,
    }
    if replicas is not None:
        states["fault_tolerance"] = replicas
    if semi_sync is not None and semi_sync.method == "diloco":
        states["diloco"] = semi_sync  # the last synced weights and the outer momentum
    checkpointer = build_checkpointer(
        config, dims, states=states, config_toml=resolved_toml, tokenizer=tokenizer
    )
    run = Run(
        config, info, dims, runtime, data, tokenizer, loader, converters, parts, optimizer,
        lr_scheduler, state, checkpointer, replicas, semi_sync,
    )  # fmt: skip
    restore_or_initialise(run)
    if semi_sync is not None and not semi_sync.loaded:  # DiLoCo starts from these weights
        semi_sync.snapshot()
    return run


def check_memory(config: JobConfig, parts, dims: ParallelDims, vocab_size: int, device, dtype):
    """Before anything is allocated: stop a job whose state and activations cannot fit in the
    memory this rank has free (on a CPU, with the other ranks on this host), warn when they
    may not."""
    need = memory_check.rank_need(
        config, parts, dims, vocab_size, device, dtype, optimizer_state_copies(config.optimizer)
    )
    problem, warning = memory_check.memory_problem(
        config, memory_check.host_needs(need, device), device
    )
    if problem:
        raise ConfigError(problem)
    if warning:
        log.warning(warning)


def set_up_layout(config: JobConfig, info: DistInfo) -> tuple[ParallelDims, torch.dtype, int]:
    """The device mesh, the seed every rank shares and the compute dtype; one log line."""
    dims = parallel_dims_for(config, info.world_size)
    mesh = dims.build_mesh(info.device.type)
    seed = config.training.seed if config.training.seed is not None else 0
    set_seed(seed, mesh, vary_over=(), deterministic=config.training.deterministic)
    dtype = compute_dtype(
        config.training.mixed_precision_param, info.device, params=config.training.dtype
    )
    log.info(
        "%s | %d processes on %s | %s | compute %s",
        config.job.description,
        info.world_size,
        info.device.type,
        layout_text(dims),
        dtype,
    )
    return dims, dtype, seed


def write_resolved_config(config: JobConfig, rank: int) -> str:
    """The config as it resolved, written to `<dump_folder>/config.toml` (rank 0); returned
    for the checkpoints, which keep it too."""
    resolved = to_toml(config)
    dump = config.job.dump_folder
    os.makedirs(dump, exist_ok=True)
    if rank == 0:
        with open(os.path.join(dump, "config.toml"), "w") as f:
            f.write(resolved)
    if config.job.print_config:
        log.info("resolved config:\n%s", resolved)
    return resolved


def build_loader(config: JobConfig, data, tokenizer, dims: ParallelDims):
    """One loader per data-parallel rank; TP/CP/PP peers of a rank read the same batches.
    Replica groups ([fault_tolerance]) each read their own share. The global batch (samples
    per optimizer step over every data-parallel rank) fixes the data's global order, so a
    job resumed on another data-parallel degree with the same global batch sees the same
    samples."""
    dp_rank, dp_world = data_coordinates(config, dims)
    t = config.training
    per_group = (
        t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp_degree
    )
    kwargs = dict(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        text_field=t.dataset_text_field,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        bad_rows=t.bad_rows,
        global_batch_size=per_group * (dp_world // dims.dp_degree),
        num_workers=t.dataloader.num_workers,
        prefetch_factor=t.dataloader.prefetch_factor,
        pin_memory=t.dataloader.pin_memory,
        seed=t.seed if t.seed is not None else 0,
    )
    return build_checked_loader(data, **plugin_kwargs(data.build_dataloader, kwargs, t.data_plugin))


def build_checkpointer(
    config: JobConfig, dims: ParallelDims, *, states: dict, config_toml: str, tokenizer
):
    """The checkpointer plugin (`checkpoint.checkpointer`) over `states`, or None when the run
    neither saves nor loads."""
    ckpt = config.checkpoint
    if not (ckpt.enable or ckpt.create_seed_checkpoint or ckpt.initial_load_path):
        return None
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    # Hugging Face import/export (initial_load_in_hf, last_save_in_hf) needs the weight names;
    # its config.json the model's own context length and the tokenizer's BOS/EOS.
    spec = resolve(plugins.MODELS, config.model.name)
    hf_adapter = (
        build_hf_adapter(
            spec,
            hf_model_args(spec, config, tokenizer.vocab_size),
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
        )
        if spec.hf_adapter
        else None
    )
    return factory(
        ckpt,
        states=states,
        dump_folder=config.job.dump_folder,
        dims=dims,
        config_toml=config_toml,
        dp_rank=dp_coordinates(dims)[0],
        hf_adapter=hf_adapter,
    )


def hf_model_args(spec, config: JobConfig, vocab_size: int):
    """The model's arguments as a Hugging Face `config.json` states them: the run's (padded)
    vocabulary, and the flavor's own context length as `max_position_embeddings` rather than
    the run's `training.seq_len` (the rotary table's length while training)."""
    args = model_args_for(spec, config, vocab_size)
    own = spec.flavors[config.model.flavor]
    if hasattr(own, "max_seq_len"):
        args = dataclasses.replace(args, max_seq_len=max(own.max_seq_len, args.max_seq_len))
    return args


def _pipeline_microbatches(runtime) -> int:
    return runtime.pipeline.n_microbatches if runtime.pipeline is not None else 1


def restore_or_initialise(run: Run) -> None:
    """The weights come from the newest complete checkpoint (or `initial_load_path`) when there
    is one; otherwise from the one initialisation, a function of the seed and each parameter's
    name. Buffers (rotary tables) are always rebuilt."""
    loaded = None
    if run.checkpointer is not None and not run.config.checkpoint.create_seed_checkpoint:
        loaded = run.checkpointer.load(run.config.checkpoint.load_step)
    run.runtime.init_weights(run.parts, parameters=loaded is None)
    if loaded:  # step 0 is a seed checkpoint: nothing to resume
        log.info(
            "resumed at step %d (%s tokens seen)", run.state.step, f"{run.state.tokens_seen:,}"
        )
    note_torchrun_restart(run, loaded)


def note_torchrun_restart(run: Run, loaded: int | None) -> None:
    """Under `torchrun --max-restarts`, say which attempt this is and where it starts; warn
    when a restart could only start over (no checkpoints)."""
    done, allowed = torchrun_restarts()
    if not allowed:
        return
    notice = restart_notice(allowed, run.checkpointer is not None, run.replicas is not None)
    if notice is not None:
        log.log(*notice)
    if done:
        log.warning(
            "torchrun restart %d of %d: training goes on from step %d (%s)",
            done,
            allowed,
            run.state.step,
            "the newest complete checkpoint" if loaded else "no checkpoint to resume from",
        )


def restart_notice(
    allowed: int, checkpointing: bool, fault_tolerance: bool
) -> tuple[int, str] | None:
    """(log level, text) of what a torchrun restart of this job will start from, when that
    is worth saying: without checkpoints a restart starts over, unless a live replica group
    (fault tolerance) hands the restarted group its step."""
    if checkpointing:
        return None
    if fault_tolerance:
        return logging.INFO, (
            f"torchrun may restart this replica group {allowed} time(s) (--max-restarts); without"
            " checkpoints a restarted group receives the weights, optimizer state and step from a"
            " live replica group, and the job starts over from step 0 only if every group is lost"
            " at once ([checkpoint] enable = true covers that too)"
        )
    return logging.WARNING, (
        f"torchrun may restart this job {allowed} time(s) (--max-restarts), but [checkpoint]"
        " enable = false: a restart trains again from step 0; turn checkpoints on so that one"
        " loses at most [checkpoint] interval steps"
    )


def write_seed_checkpoint(run: Run) -> TrainResult:
    run.checkpointer.save(0, last_step=True)
    run.checkpointer.close()
    log.info("seed checkpoint written; start training without --checkpoint.create_seed_checkpoint")
    return TrainResult(0, 0, [], False)


# ----------------------------------------------------------------------------- the steps


class _StopRequest:
    """SIGTERM (a scheduler's preemption notice, or torchrun stopping the ranks after one
    failed) asks the loop to checkpoint and stop. This rank's flight-recorder trace is written
    at once too: a rank stuck outside a collective would otherwise leave none."""

    def __init__(self, on_signal=None) -> None:
        self.requested = False
        self._previous = None
        self._on_signal = on_signal

    def __enter__(self) -> _StopRequest:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if self._on_signal is not None:
            self._on_signal()

    def __exit__(self, exc_type, *_) -> None:
        if self._previous is None:
            return
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            # Stopping on an error: when a peer died, torchrun's SIGTERM follows within
            # moments, and it must not end this rank before its error is reported.
            signal.signal(signal.SIGTERM, lambda *_: None)
            return
        signal.signal(signal.SIGTERM, self._previous)


@dataclass
class _Window:
    """What the metric line of one logging window is computed from."""

    metrics: MetricsLogger
    timer: StepTimer
    memory: MemoryMonitor
    peak_flops: float
    flops_per_token: float
    experts: ExpertLoad
    lr: float = 0.0
    """The learning rate the last step ran at (the optimizer holds the next step's)."""


def run_steps(run: Run) -> TrainResult:
    """Train from the current step to `training.steps`: each step, then what is due after it
    (metrics, validation, profiling, checkpoint), until the end or a stop request."""
    config, state = run.config, run.state
    accum = accumulation_steps(config, run.dims)
    peak = peak_flops(
        run.info.device, run.runtime.dtype, override_tflops=config.metrics.peak_tflops
    )
    log.info("peak %s; %d microbatch(es) per step", peak.describe(), accum)
    window = _Window(
        MetricsLogger(
            run.dump,
            config.metrics.save_tb_folder,
            config.metrics.enable_tensorboard,
            run.info.rank,
            enable_wandb=config.metrics.enable_wandb,
            run_name=config.job.description,
            run_config=config_to_dict(config),
            plots_folder=config.metrics.save_plots_folder,
            run_id=run.state.run_id,
        ),
        StepTimer(),
        MemoryMonitor(run.info.device),
        peak.flops,
        run.runtime.flops_per_token,
        # Each forward adds its auxiliary balance loss: weigh it by the forwards per step
        # (accumulated microbatches, and the pipeline's microbatches within each).
        ExpertLoad(run.parts, run.dims, accum * _pipeline_microbatches(run.runtime)),
    )
    validator = build_validator(run) if config.validation.enable else None
    guard = StepGuard(run.optimizer, config.training.max_nonfinite_in_a_row)
    batches = iter(run.loader)
    if run.replicas is not None:  # a discarded step is retried on the same batches
        batches = StepBatches(batches, accum)
    tokens_per_step = config.training.local_batch_size * config.training.seq_len * accum
    start_step = state.step
    stopped_early = failed = False
    stopped_by = None
    gc.disable()
    try:
        with (
            report_collective_failures(
                config.comm,
                run.dump,
                run.info.rank,
                started=lambda: state.step > start_step + 1,
                step=lambda: state.step,
            ),
            _StopRequest(on_signal=lambda: dump_trace(config, run.dump, run.info.rank)) as stop,
            maybe_profile(config.profiling, run.dump, run.info.rank, state.step) as profile_step,
            maybe_memory_snapshot(config.profiling, run.dump, run.info.rank),
        ):
            while state.step < config.training.steps:
                state.step += 1
                attempted = state.step
                recovered = 0 if run.replicas is None else len(run.replicas.recoveries)
                # Semi-synchronous groups step alone and synchronise every few steps.
                every_step = run.replicas if run.semi_sync is None else None
                # This step's lr comes from the schedule and the step alone, never from what a
                # loaded checkpoint left in the optimizer's param_groups.
                run.lr_scheduler.apply()
                outcome = train_step(
                    run.runtime, run.parts, run.optimizer, batches, accum, window.timer, config,
                    guard, state.step, replicas=every_step,
                )  # fmt: skip
                if run.replicas is not None and not settle_replica_step(
                    run.replicas, run.semi_sync, batches, state, attempted, recovered,
                    outcome.committed,
                ):  # fmt: skip  # discarded on every replica group: attempted again
                    if stop.requested:
                        stopped_early, stopped_by = True, "SIGTERM"
                        save_if_due(run, last=False, preempted=True)
                        break
                    continue
                window.lr = current_lr(run.optimizer)  # the lr this step ran at
                run.lr_scheduler.step()
                if state.step == start_step + 1:  # compiled and warmed up: the tight timeout
                    start_training_timeout(config.comm, state.step)
                for converter in run.converters:
                    for part in run.parts:
                        converter.post_optimizer_hook(part)
                if window.experts:
                    window.experts.after_step()
                groups = 1
                if run.replicas is not None:  # before the first quorum: every group planned
                    groups = run.replicas.participants() or config.fault_tolerance.group_size
                state.tokens_seen += tokens_per_step * run.dims.dp_degree * groups
                window.timer.tokens += tokens_per_step
                window.timer.steps += 1
                last = state.step == config.training.steps
                if (
                    state.step % config.metrics.log_freq == 0
                    or state.step == start_step + 1
                    or last
                ):
                    log_window(run, window, guard)
                if validator is not None and (validator.due(state.step) or last):
                    validate(run, window, validator)
                if profile_step is not None:
                    profile_step()
                if stop.requested:
                    state.losses.extend(row[1] for row in guard.read())
                    stopped_early, stopped_by = True, "SIGTERM"
                save_if_due(run, last=last, preempted=stopped_early)
                if stopped_early:
                    break
                if state.step % config.training.gc_freq == 0:
                    gc.collect(1)
    except KeyboardInterrupt:
        log.warning(
            "Ctrl-C: stopped at step %d; the last complete checkpoint stays the one to resume from",
            state.step,
        )
        stopped_early, stopped_by = True, "SIGINT"
    except BaseException:
        failed = True
        raise
    finally:
        gc.enable()
        close_checkpointer(run.checkpointer, after_error=failed)
        window.metrics.close()
        close_loader = getattr(run.loader, "close", None)
        if callable(close_loader):  # its worker processes, before the interpreter exits
            close_loader()
        if run.replicas is not None:  # leaves the quorums; torchft's threads stop
            run.replicas.close()
    return TrainResult(state.step - start_step, state.step, state.losses, stopped_early, stopped_by)


def close_checkpointer(checkpointer, after_error: bool) -> None:
    """Finish the checkpointer's in-flight save. After an error a peer may be gone, and closing
    (it may wait on the other ranks) can fail too: that failure is logged, not raised, so that
    the error reported is the one that ended the run."""
    if checkpointer is None:
        return
    if not after_error:
        checkpointer.close()
        return
    try:
        checkpointer.close()
    except Exception as e:  # the run's own error is already on its way out
        log.warning(
            "the checkpointer could not finish after the error (%s); the newest complete"
            " checkpoint is unaffected",
            str(e).splitlines()[0][:200],
        )


def train_step(
    runtime: ParallelRuntime,
    model_parts,
    optimizer,
    batches: Iterator,
    accum: int,
    timer: StepTimer,
    config,
    guard: StepGuard,
    step: int,
    *,
    replicas=None,
) -> StepOutcome:
    """Forward/backward over `accum` microbatches, clip, check, step. The loss and gradient
    norm are device tensors, both reduced over every rank so that all ranks log the same
    numbers; nothing is read back to the host here (see StepGuard). With `replicas` (a TorchFT
    `ReplicaGroup`) the gradients are averaged over the replica groups before clipping, and the
    optimizer steps only if every group completed the step (`committed`)."""
    optimizer.zero_grad(set_to_none=True)
    if replicas is not None:
        replicas.start_step()  # the quorum forms while the forward pass runs
    total = torch.zeros((), device=runtime.device)
    for _ in range(accum):
        start = time.perf_counter()
        inputs, labels = next(batches)
        timer.data_seconds += time.perf_counter() - start
        inputs = inputs.to(runtime.device, non_blocking=True)
        labels = labels.to(runtime.device, non_blocking=True)
        total += runtime.forward_backward(model_parts, inputs, labels, scale=1.0 / accum)
    if replicas is not None:
        replicas.average_gradients(p for part in model_parts for p in part.parameters())
    grad_norm = runtime.clip_grad_norm(model_parts, config.training.max_norm)
    loss = runtime.reduce_loss(total)
    # Every rank of every group votes, whatever its own step looks like.
    committed = replicas is None or replicas.should_commit()
    # A NaN or inf step is never applied: skipped on the device, or here.
    if committed and guard.before_step(step, loss, grad_norm, local_loss=total):
        optimizer.step()
    return StepOutcome(loss, grad_norm, committed)


class StepOutcome(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor
    committed: bool
    """False when fault tolerance discarded the step (a replica group failed): not applied
    anywhere, to be attempted again."""


def log_window(run: Run, window: _Window, guard: StepGuard) -> None:
    """One metric line for the steps since the last one: the one read-back of their values
    (it raises if a step was not finite)."""
    rows = guard.read()
    run.state.losses.extend(row[1] for row in rows)
    _, loss, grad_norm = rows[-1]
    values = window_metrics(window, loss, grad_norm, run.dims)
    values["skipped_rows"] = skipped_rows_total(run.loader, run.dims.mesh("dp"), run.info.device)
    by_source = getattr(run.loader, "tokens_by_source", None)
    if by_source and len(by_source) > 1:  # a mixture: tokens the whole job took from each
        values.update({f"tokens/{label}": float(n) for label, n in by_source.items()})
    values["skipped_steps"] = guard.skipped
    if (load := window.experts.read()) is not None:  # the worst layer, then each layer
        values["expert_load"] = max(load.values())
        values.update({f"expert_load/{name}": ratio for name, ratio in load.items()})
    if run.replicas is not None and run.replicas.participants():  # in the last quorum
        values["replica_groups"] = run.replicas.participants()
    window.metrics.log(run.state.step, values)
    window.timer.reset()


def build_validator(run: Run) -> Validator:
    dp_rank, dp_world = dp_coordinates(run.dims)
    return Validator(
        run.config.validation,
        run.data,
        run.config.training.data_plugin,
        run.tokenizer,
        dp_rank,
        dp_world,
        run.config.training.seq_len,
        run.config.training.bad_rows,
    )


def validate(run: Run, window: _Window, validator: Validator) -> None:
    loss = validator.run(run.runtime, run.parts)
    log.info("step %4d | validation loss %.4f", run.state.step, loss)
    window.metrics.log_scalars(run.state.step, {"validation_loss": loss})
    window.timer.reset()  # validation time is not training throughput


def save_if_due(run: Run, *, last: bool, preempted: bool) -> None:
    """The checkpointer decides whether a step is due; a preemption save is a full, resumable
    one, never the last step's export."""
    saving = run.checkpointer is not None and run.config.checkpoint.enable
    if preempted:
        if saving:
            log.warning("SIGTERM: saving a full checkpoint at step %d and stopping", run.state.step)
        else:
            log.warning(
                "SIGTERM: stopping at step %d without a checkpoint (checkpoint.enable is false)",
                run.state.step,
            )
    if saving:
        # `force` goes only to a save that needs it (older checkpointers lack it).
        forced = {"force": True} if preempted and not last else {}
        run.checkpointer.save(run.state.step, last_step=last, **forced)


def window_metrics(window: _Window, loss, grad_norm, dims: ParallelDims) -> dict[str, float]:
    timer = window.timer
    elapsed = time.perf_counter() - timer.window_start
    # A TP/CP/PP group shares the work on one data-parallel rank's tokens.
    tokens_per_s = timer.tokens / elapsed / (dims.tp * dims.cp * dims.pp)
    flops = window.flops_per_token * tokens_per_s
    stats = window.memory.stats()
    window.memory.reset_peak()
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": window.lr,
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu_pct": 100.0 * flops / window.peak_flops,
        "mem_peak_gib": stats.peak_gib,
        "step_time_s": elapsed / max(timer.steps, 1),
        "data_pct": 100.0 * timer.data_seconds / elapsed,
    }


# ----------------------------------------------------------------------------- small helpers


def layout_text(dims: ParallelDims) -> str:
    """The layout in one phrase: `dp_shard 8 x tp 8`, `dp_shard 16 (ep 8)` (expert parallel
    borrows its ranks from dp_shard x cp), or `single process`."""
    parts = [
        f"{name} {getattr(dims, name)}"
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
        if getattr(dims, name) > 1
    ]
    text = " x ".join(parts) or "single process"
    return f"{text} (ep {dims.ep})" if dims.ep > 1 else text


def dp_coordinates(dims: ParallelDims) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree)."""
    mesh = dims.mesh("dp")
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())


def accumulation_steps(config: JobConfig, dims: ParallelDims) -> int:
    """Microbatches per optimizer step that `training.global_batch_size` asks for."""
    if config.training.global_batch_size == -1:
        return 1
    return config.training.global_batch_size // (config.training.local_batch_size * dims.dp_degree)


def config_section(config: JobConfig, dotted: str):
    """The config section named like a converter (`quantize.linear.float8`), or None."""
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node
