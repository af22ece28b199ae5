"""The training recipe: config -> mesh -> data -> model on meta -> convert -> parallelize ->
init -> optimizer -> schedule -> checkpoint -> steps.

Every concrete piece (model family, data package, checkpointer, converters) is found by name
through titan-core's plugin registry; this file only composes them.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import (
    ConfigError,
    MemoryMonitor,
    ParallelDims,
    get_logger,
    init_distributed,
    peak_flops,
    plugins,
    resolve,
    resolve_device_type,
    set_seed,
    supports_bf16,
    to_toml,
)
from titan_core.distributed import destroy_distributed
from titan_trainer.checks import model_args_for, state_memory_problem
from titan_trainer.config import JobConfig
from titan_trainer.guards import (
    StepGuard,
    build_checked_loader,
    claim_run_folders,
    skipped_rows_total,
)
from titan_trainer.lr_schedule import build_lr_scheduler
from titan_trainer.metrics import MetricsLogger, StepTimer
from titan_trainer.optimizer import build_optimizer
from titan_trainer.parallel import ParallelRuntime, build_parallel_runtime
from titan_trainer.profiling import maybe_memory_snapshot, maybe_profile
from titan_trainer.validate import Validator

log = get_logger("train")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class TrainState:
    """What the checkpoint needs to know about progress, besides modules and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    losses: list[float] = field(default_factory=list)
    """Loss per step in this process's lifetime, read back at logging steps (not checkpointed;
    for tests and summaries)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    losses: list[float]
    stopped_early: bool


class _StopRequest:
    """SIGTERM (a scheduler's preemption notice) asks the loop to checkpoint and stop."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> _StopRequest:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """bfloat16 where the device computes it natively; float32 otherwise."""
    if name == "float32":
        return torch.float32
    if supports_bf16(device):
        return torch.bfloat16
    if name == "bfloat16":
        log.warning(
            "training.mixed_precision_param = bfloat16, but %s has no native bf16; training in float32",
            device,
        )
    return torch.float32


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


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
    args = model_args_for(spec, config, vocab_size)
    with torch.device("meta"):
        model = spec.build(args)
    for converter in converters:
        converter.convert(model)
    if config.model.print_after_conversion:
        log.info("model after conversion:\n%s", model)
    return runtime.parallelize(model, stage_io)


def train(config: JobConfig) -> TrainResult:
    device_type = resolve_device_type(config.job.device)
    info = init_distributed(device_type, config.comm.init_timeout_seconds)
    try:
        # Before anything is written: one run per dump folder, and folders that take writes.
        lock = claim_run_folders(config, info.rank)
        try:
            return _train(config, info)
        finally:
            if lock is not None:
                lock.release()
    finally:
        destroy_distributed()


def _train(config: JobConfig, info) -> TrainResult:
    device = info.device
    dims = ParallelDims(
        world_size=info.world_size,
        dp_replicate=config.parallelism.data_parallel_replicate_degree,
        dp_shard=config.parallelism.data_parallel_shard_degree,
        cp=config.parallelism.context_parallel_degree,
        tp=config.parallelism.tensor_parallel_degree,
        pp=config.parallelism.pipeline_parallel_degree,
        ep=config.parallelism.expert_parallel_degree,
    )
    mesh = dims.build_mesh(device.type)
    seed = config.training.seed if config.training.seed is not None else 0
    set_seed(seed, mesh, vary_over=(), deterministic=config.training.deterministic)
    dtype = compute_dtype(config.training.mixed_precision_param, device)
    log.info(
        "%s | %d processes on %s | %s | compute %s",
        config.job.description,
        info.world_size,
        device.type,
        layout_text(dims),
        dtype,
    )

    dump = config.job.dump_folder
    os.makedirs(dump, exist_ok=True)
    resolved_toml = to_toml(config)
    if info.rank == 0:
        with open(os.path.join(dump, "config.toml"), "w") as f:
            f.write(resolved_toml)
    if config.job.print_config:
        log.info("resolved config:\n%s", resolved_toml)

    # Data: one loader per data-parallel rank; TP/CP/PP peers of a rank read the same batches.
    data = resolve(plugins.DATA, config.training.data_plugin)
    tokenizer = data.build_tokenizer(config.model.hf_assets_path or config.model.tokenizer_path)
    dp_rank, dp_world = _dp_coordinates(dims)
    loader = build_checked_loader(
        data,
        dataset=config.training.dataset,
        dataset_path=config.training.dataset_path,
        tokenizer=tokenizer,
        seq_len=config.training.seq_len,
        batch_size=config.training.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        bad_rows=config.training.bad_rows,
    )

    converters = [
        resolve(plugins.CONVERTERS, name)(_section(config, name), dims)
        for name in config.model.converters
    ]
    runtime = build_parallel_runtime(config, dims, device, dtype, seed, cross_entropy_loss)
    model_parts = build_model(config, runtime, tokenizer.vocab_size, converters)
    problem = state_memory_problem(model_parts, device)
    if problem:  # before anything is allocated: this job cannot hold its state here
        raise ConfigError(problem)
    runtime.materialize(model_parts)
    optimizer = build_optimizer(model_parts, config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    state = TrainState()

    checkpointer = _build_checkpointer(
        config,
        dims,
        model_parts,
        optimizer,
        lr_scheduler,
        loader,
        state,
        resolved_toml,
        dp_rank,
        tokenizer.vocab_size,
    )
    seeding = config.checkpoint.create_seed_checkpoint
    loaded = None
    if checkpointer is not None and not seeding:
        loaded = checkpointer.load(config.checkpoint.load_step)
    # The one place weights get values, unless a checkpoint already gave them.
    runtime.init_weights(model_parts, parameters=loaded is None)
    if checkpointer is not None and seeding:
        checkpointer.save(0, last_step=True)
        checkpointer.close()
        log.info(
            "seed checkpoint written; start training without --checkpoint.create_seed_checkpoint"
        )
        return TrainResult(0, 0, [], False)
    if loaded:  # step 0 is a seed checkpoint: nothing to resume
        log.info("resumed at step %d (%s tokens seen)", state.step, f"{state.tokens_seen:,}")

    accum = _accumulation_steps(config, dims)
    flops_per_token = runtime.flops_per_token
    peak = peak_flops(device, dtype, override_tflops=config.metrics.peak_tflops)
    log.info("peak %s; %d microbatch(es) per step", peak.describe(), accum)
    metrics = MetricsLogger(
        dump, config.metrics.save_tb_folder, config.metrics.enable_tensorboard, info.rank
    )
    memory = MemoryMonitor(device)

    batches = iter(loader)
    tokens_per_step_per_dp = config.training.local_batch_size * config.training.seq_len * accum
    timer = StepTimer()
    start_step = state.step
    stopped_early = False
    validator = (
        Validator(
            config.validation,
            data,
            tokenizer,
            dp_rank,
            dp_world,
            config.training.seq_len,
            config.training.bad_rows,
        )
        if config.validation.enable
        else None
    )
    guard = StepGuard(optimizer)
    gc.disable()
    try:
        with (
            _StopRequest() as stop,
            maybe_profile(config.profiling, dump, info.rank, state.step) as profile_step,
            maybe_memory_snapshot(config.profiling, dump, info.rank),
        ):
            while state.step < config.training.steps:
                state.step += 1
                loss, grad_norm = train_step(
                    runtime,
                    model_parts,
                    optimizer,
                    batches,
                    accum,
                    timer,
                    config,
                    guard,
                    state.step,
                )
                lr_scheduler.step()
                for converter in converters:
                    for part in model_parts:
                        converter.post_optimizer_hook(part)
                state.tokens_seen += tokens_per_step_per_dp * dims.dp_degree
                timer.tokens += tokens_per_step_per_dp
                timer.steps += 1
                last = state.step == config.training.steps
                if (
                    state.step % config.metrics.log_freq == 0
                    or state.step == start_step + 1
                    or last
                ):
                    # The one read-back of the step's values; raises if a step was not finite.
                    rows = guard.read()
                    state.losses.extend(row[1] for row in rows)
                    _, loss, grad_norm = rows[-1]
                    window = _window_metrics(
                        timer, loss, grad_norm, optimizer, dims, flops_per_token, peak.flops, memory
                    )
                    window["skipped_rows"] = skipped_rows_total(loader, dims.mesh("dp"), device)
                    metrics.log(state.step, window)
                    timer.reset()
                if validator is not None and (validator.due(state.step) or last):
                    val_loss = validator.run(runtime, model_parts)
                    log.info("step %4d | validation loss %.4f", state.step, val_loss)
                    metrics.log_scalars(state.step, {"validation_loss": val_loss})
                    timer.reset()
                if profile_step is not None:
                    profile_step()
                saving = checkpointer is not None and config.checkpoint.enable
                if stop.requested:
                    state.losses.extend(row[1] for row in guard.read())
                    if saving:
                        log.warning(
                            "SIGTERM: saving a full checkpoint at step %d and stopping", state.step
                        )
                    else:
                        log.warning(
                            "SIGTERM: stopping at step %d without a checkpoint "
                            "(checkpoint.enable is false)",
                            state.step,
                        )
                    stopped_early = True
                if saving:
                    # A preemption save is a full, resumable one, never the last step's export;
                    # `force` goes only to a save that needs it (older checkpointers lack it).
                    forced = {"force": True} if stopped_early and not last else {}
                    checkpointer.save(state.step, last_step=last, **forced)
                if stopped_early:
                    break
                if state.step % config.training.gc_freq == 0:
                    gc.collect(1)
    except KeyboardInterrupt:
        log.warning(
            "Ctrl-C: stopped at step %d; the last complete checkpoint stays the one to resume from",
            state.step,
        )
        stopped_early = True
    finally:
        gc.enable()
        if checkpointer is not None:
            checkpointer.close()
        metrics.close()
    return TrainResult(state.step - start_step, state.step, state.losses, stopped_early)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over `accum` microbatches, clip, check, step. Returns (loss, grad_norm)
    as device tensors, both reduced over every rank so that all ranks log the same numbers;
    nothing is read back to the host here (see StepGuard)."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=runtime.device)
    for _ in range(accum):
        start = time.perf_counter()
        inputs, labels = next(batches)
        timer.data_seconds += time.perf_counter() - start
        inputs = inputs.to(runtime.device, non_blocking=True)
        labels = labels.to(runtime.device, non_blocking=True)
        total += runtime.forward_backward(model_parts, inputs, labels, scale=1.0 / accum)
    grad_norm = runtime.clip_grad_norm(model_parts, config.training.max_norm)
    loss = runtime.reduce_loss(total)
    guard.before_step(step, loss, grad_norm)  # a NaN or inf step is skipped, never applied
    optimizer.step()
    return loss, grad_norm


def _window_metrics(
    timer: StepTimer, loss, grad_norm, optimizer, dims: ParallelDims, flops_per_token, peak, memory
) -> dict[str, float]:
    elapsed = time.perf_counter() - timer.window_start
    # A TP/CP/PP group shares the work on one data-parallel rank's tokens.
    tokens_per_s = timer.tokens / elapsed / (dims.tp * dims.cp * dims.pp)
    flops = flops_per_token * tokens_per_s
    stats = memory.stats()
    memory.reset_peak()
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": optimizer.param_groups[0]["lr"],
        "tokens_per_s": tokens_per_s,
        "tflops": flops / 1e12,
        "mfu_pct": 100.0 * flops / peak,
        "mem_peak_gib": stats.peak_gib,
        "step_time_s": elapsed / max(timer.steps, 1),
        "data_pct": 100.0 * timer.data_seconds / elapsed,
    }


def layout_text(dims: ParallelDims) -> str:
    """The layout in one phrase: `dp_shard 8 x tp 8`, or `single process`."""
    parts = [
        f"{name} {getattr(dims, name)}"
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
        if getattr(dims, name) > 1
    ]
    return " x ".join(parts) or "single process"


def _dp_coordinates(dims: ParallelDims) -> tuple[int, int]:
    mesh = dims.mesh("dp")
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())


def _accumulation_steps(config: JobConfig, dims: ParallelDims) -> int:
    per_step = config.training.local_batch_size * dims.dp_degree
    if config.training.global_batch_size == -1:
        return 1
    return config.training.global_batch_size // per_step


def _section(config: JobConfig, dotted: str):
    """The config section named like a converter (`quantize.linear.float8`), or None."""
    node: Any = config
    for part in dotted.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _build_checkpointer(
    config,
    dims,
    model_parts,
    optimizer,
    lr_scheduler,
    loader,
    state,
    resolved_toml,
    dp_rank,
    vocab_size,
):
    ckpt = config.checkpoint
    if not (ckpt.enable or ckpt.create_seed_checkpoint or ckpt.initial_load_path):
        return None
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    # Hugging Face import/export (initial_load_in_hf, last_save_in_hf) needs the weight names.
    spec = resolve(plugins.MODELS, config.model.name)
    hf_adapter = (
        spec.hf_adapter(model_args_for(spec, config, vocab_size)) if spec.hf_adapter else None
    )
    return factory(
        ckpt,
        states={
            "model": model_parts,
            "optimizer": optimizer,
            "lr_scheduler": lr_scheduler,
            "dataloader": loader,
            "train_state": state,
        },
        dump_folder=config.job.dump_folder,
        dims=dims,
        config_toml=resolved_toml,
        dp_rank=dp_rank,
        hf_adapter=hf_adapter,
    )
