"""The training recipe, in the order it runs:

    process group -> layout (mesh, seed, dtype) -> resolved config written -> tokenizer ->
    model on the meta device -> converters -> parallelize -> storage -> data loader ->
    optimizer and schedule -> checkpointer -> weights (from a checkpoint, or the one
    initialisation) -> steps

Every concrete piece (model family, data package, checkpointer, converters, metric sinks) is
found by name through titan-core's plugin registry; this file only composes them. `prepare`
builds a `Run` (everything a run holds, built once, in named parts); `run_steps` trains it.
"""

from __future__ import annotations

import gc
import os
import tomllib

import torch

from titan_core import (
    ConfigError,
    DistInfo,
    ParallelDims,
    dp_coordinates,
    get_logger,
    init_distributed,
    plugins,
    resolve,
    resolve_device_type,
    set_seed,
    to_toml,
)
from titan_core.distributed import destroy_distributed
from titan_parallel import QKClip
from titan_trainer import memory_check
from titan_trainer.attention import apply_attention_backend
from titan_trainer.checkpointing.build import build_checkpointer
from titan_trainer.checkpointing.plan import CheckpointPlan
from titan_trainer.checkpointing.saving import RunCheckpoints
from titan_trainer.checks import block_causal_device_problem
from titan_trainer.comm import (
    dump_trace,
    report_collective_failures,
    start_training_timeout,
    trace_folder,
)
from titan_trainer.config import JobConfig
from titan_trainer.data import build_loader, checkpointed_loader
from titan_trainer.downstream import TaskEvaluator, load_tasks
from titan_trainer.fault_tolerance import build_step_coordinator
from titan_trainer.guards import StepGuard, claim_run_folders
from titan_trainer.layout import Layout, layout_text
from titan_trainer.logs import rank_logging
from titan_trainer.loss import cross_entropy_loss
from titan_trainer.lr_schedule import build_lr_scheduler
from titan_trainer.model import build_converters, build_model
from titan_trainer.optimizer import build_optimizer, current_lr, optimizer_state_copies
from titan_trainer.precision import compute_dtype
from titan_trainer.profiling import maybe_memory_snapshot, maybe_profile
from titan_trainer.restarts import note_torchrun_restart
from titan_trainer.run import (
    Optimization,
    Run,
    RunData,
    RunModel,
    TrainResult,
    TrainState,
    run_label,
    shared_run_id,
)
from titan_trainer.runtime import build_parallel_runtime
from titan_trainer.shipped import find_config_file
from titan_trainer.step import train_step
from titan_trainer.stopping import StopAgreement, StopRequest, close_run
from titan_trainer.validate import Validator
from titan_trainer.window import MetricWindow, evaluate_if_due, log_window, open_window

log = get_logger("train")


# ----------------------------------------------------------------------------- the run


def train(config: JobConfig, layout: Layout | None = None) -> TrainResult:
    """Run the job `config` describes on this process (one rank of it under torchrun).
    `layout`: what the pre-start checks resolved (`titan_trainer.preflight`), else resolved
    here."""
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
                run = prepare(config, info, layout)
                if run.checkpoints.plan.seed:
                    run.checkpoints.write_seed()
                    return TrainResult(0, 0, [], False)
                return run_steps(run)
        finally:
            if lock is not None:
                lock.release()
    finally:
        destroy_distributed()


def prepare(config: JobConfig, info: DistInfo, layout: Layout | None = None) -> Run:
    """Every piece of the run, built in the recipe's order, with its weights in place."""
    if layout is None or layout.world_size != info.world_size:
        layout = Layout.resolve(config, info.world_size)
    dims, dtype, seed = set_up_layout(config, info, layout)
    resolved_toml = write_resolved_config(config, info.rank)
    data = resolve(plugins.DATA, config.training.data_plugin)
    tokenizer = data.build_tokenizer(config.model.tokenizer_source()[0])

    runtime = build_parallel_runtime(config, dims, info.device, dtype, seed, cross_entropy_loss)
    if config.model.attn_mask_type == "block_causal":  # documents start at BOS
        problem = block_causal_device_problem(config, info.device, layout.spec)
        if problem:  # before anything is allocated: never train with a wrong mask
            raise ConfigError(problem)
        runtime.document_start_id = tokenizer.bos_id
    converters = build_converters(config, dims)
    # The memory check measures activations on a copy of the model the checks read, before
    # that model is converted and parallelized.
    spare = layout.spare_model(tokenizer.vocab_size) if not dims.pp_enabled else None
    parts = build_model(config, runtime, tokenizer.vocab_size, converters, layout=layout)
    # Timed or checked on the device before the model takes its memory.
    apply_attention_backend(config, parts, dims, info.device, runtime.dtype)
    check_memory(config, parts, dims, tokenizer.vocab_size, info.device, runtime.dtype, spare)
    runtime.materialize(parts)
    model = RunModel(runtime, converters, parts)

    loader = build_loader(config, data, tokenizer, dims, layout.batch)
    optimizer = build_optimizer(
        parts, config.optimizer, total_steps=config.training.steps, dims=dims
    )
    lr_scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    state = TrainState(run_id=shared_run_id(run_label(config)))
    coordinator = build_step_coordinator(config, info, parts, optimizer, lr_scheduler, state)
    states = {
        "model": parts,
        "optimizer": optimizer,
        "lr_scheduler": lr_scheduler,
        # One global position of the data that any data-parallel degree resumes from; replica
        # groups (their own jobs and checkpoints) keep their own.
        "dataloader": checkpointed_loader(
            loader, dims.mesh("dp"), per_rank=coordinator.per_rank_data
        ),
        "train_state": state,
        **coordinator.checkpoint_states(),
    }
    checkpointer = build_checkpointer(
        config, dims, layout.spec, states=states, config_toml=resolved_toml, tokenizer=tokenizer
    )
    run = Run(
        config=config,
        info=info,
        layout=layout,
        model=model,
        data=RunData(data, tokenizer, loader),
        optimization=Optimization(optimizer, lr_scheduler, build_qk_clip(config, parts, dims)),
        state=state,
        checkpoints=RunCheckpoints(
            CheckpointPlan.of(config.checkpoint), checkpointer, config.checkpoint
        ),
        coordinator=coordinator,
    )
    restore_or_initialise(run)
    coordinator.after_restore()
    return run


def check_memory(
    config: JobConfig, parts, dims: ParallelDims, vocab_size: int, device, dtype, model=None
) -> None:
    """Before anything is allocated: stop a job whose state and activations cannot fit in the
    memory this rank has free (on a CPU, with the other ranks on this host), warn when they
    may not. `model`: a meta-device copy of the full model for the activations."""
    copies = optimizer_state_copies(config.optimizer)
    need = memory_check.rank_need(config, parts, dims, vocab_size, device, dtype, copies, model)
    problem, warning = memory_check.memory_problem(
        config, memory_check.host_needs(need, device), device
    )
    if problem:
        raise ConfigError(problem)
    if warning:
        log.warning(warning)


def set_up_layout(
    config: JobConfig, info: DistInfo, layout: Layout | None = None
) -> tuple[ParallelDims, torch.dtype, int]:
    """The device mesh (on the dims of `layout`, resolved here when not given), the seed every
    rank shares and the compute dtype; one log line."""
    layout = layout or Layout.resolve(config, info.world_size)
    dims = layout.dims
    mesh = dims.build_mesh(info.device.type)
    seed = config.training.seed if config.training.seed is not None else 0
    set_seed(seed, mesh, vary_over=(), deterministic=config.training.deterministic)
    dtype = compute_dtype(
        config.training.mixed_precision_param, info.device, params=config.training.dtype
    )
    processes = f"{info.world_size} process{'' if info.world_size == 1 else 'es'}"
    log.info(
        "%s | %s on %s | %s | compute %s",
        run_title(config),
        processes,
        info.device.type,
        layout_text(dims, layout.cp_style()),
        dtype,
    )
    return dims, dtype, seed


def run_title(config: JobConfig) -> str:
    """What the run trains on what: `[job] description`, then the model and the dataset in
    force. The description is the TOML's words about the TOML's data: when the command line
    trains on other data, it is left out rather than shown wrong."""
    t = config.training
    facts = f"{config.model.name} {config.model.flavor} on {t.dataset}"
    written = _toml_dataset(config.job.config_file, default=type(t)().dataset)
    if not config.job.description or (written is not None and written != t.dataset):
        return facts
    return f"{config.job.description} | {facts}"


def _toml_dataset(config_file: str | None, default: str) -> str | None:
    """The `[training] dataset` the job's TOML trains on (`default` when it names none), or
    None without a TOML."""
    if not config_file:
        return None
    try:
        data = tomllib.loads(find_config_file(config_file).read_text())
    except (OSError, ValueError):
        return None
    return data.get("training", {}).get("dataset", default)


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


def restore_or_initialise(run: Run) -> None:
    """The weights come from the newest complete checkpoint (or `initial_load_path`) when there
    is one; otherwise from the one initialisation, a function of the seed and each parameter's
    name. Buffers (rotary tables) are always rebuilt."""
    loaded = run.checkpoints.load()
    run.model.runtime.init_weights(run.model.parts, parameters=loaded is None)
    if loaded:  # step 0 is a seed checkpoint: nothing to resume
        log.info(
            "resumed at step %d (%s tokens seen)", run.state.step, f"{run.state.tokens_seen:,}"
        )
    note_torchrun_restart(run, loaded)


def run_steps(run: Run) -> TrainResult:
    """Train from the current step to `training.steps`: each step, then what is due after it
    (metrics, validation, profiling, checkpoint), until the end or a stop request."""
    config, state, model = run.config, run.state, run.model
    accum = run.batch.accumulation
    window = open_window(run)
    validator = build_validator(run) if config.validation.enable else None
    evaluator = build_evaluator(run) if config.eval.tasks else None
    optimizer = run.optimization.optimizer
    guard = StepGuard(optimizer, config.training.max_nonfinite_in_a_row)
    batches = run.coordinator.batches(iter(run.data.loader), accum)
    start_step = state.step
    agreement = StopAgreement(run.info.world_size)
    stopped_by, failed = None, False
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
            StopRequest(on_signal=lambda: dump_trace(config, run.dump, run.info.rank)) as stop,
            maybe_profile(config.profiling, run.dump, run.info.rank, state.step) as profile_step,
            maybe_memory_snapshot(config.profiling, run.dump, run.info.rank),
        ):
            while state.step < config.training.steps:
                if stop.interrupted:
                    raise KeyboardInterrupt  # Ctrl-C during the last step: stopped below
                state.step += 1
                # This step's lr comes from the schedule and the step alone, never from what a
                # loaded checkpoint left in the optimizer's param_groups.
                run.optimization.lr_scheduler.apply()
                outcome = train_step(
                    model.runtime, model.parts, optimizer, batches, accum, window.timer, config,
                    guard, state.step, coordinator=run.coordinator,
                )  # fmt: skip
                stands = run.coordinator.settle(state, outcome.committed)
                stopping = agreement.poll(stop.requested)
                if not stands:
                    if stopping:  # discarded, then preempted: save the step before it
                        stopped_by = "SIGTERM"
                        run.checkpoints.save_if_due(state.step, last=False, preempted=True)
                        break
                    continue  # discarded everywhere: attempted again
                after_step(run, window, first=state.step == start_step + 1)
                last = state.step == config.training.steps
                if (
                    state.step % config.metrics.log_freq == 0
                    or state.step == start_step + 1
                    or last
                ):
                    log_window(run, window, guard)
                evaluate_if_due(run, window, validator, evaluator, last=last)
                if profile_step is not None:
                    profile_step()
                if stopping:
                    state.losses.extend(row[1] for row in guard.read())
                    stopped_by = "SIGTERM"
                run.checkpoints.save_if_due(state.step, last=last, preempted=stopped_by is not None)
                if stopped_by is not None:
                    break
                if state.step % config.training.gc_freq == 0:
                    gc.collect(1)
    except KeyboardInterrupt:
        log.warning(run.checkpoints.after_interrupt(state.step, start_step))
        stopped_by = "SIGINT"
    except BaseException:
        failed = True
        raise
    finally:
        agreement.close(after_error=failed)
        gc.enable()
        window.metrics.close()
        close_run(run, after_error=failed)
    steps_run = state.step - start_step
    return TrainResult(steps_run, state.step, state.losses, stopped_by is not None, stopped_by)


def after_step(run: Run, window: MetricWindow, *, first: bool) -> None:
    """What follows a step that stands: the schedule moves on, the converters' hooks run, the
    step's tokens are counted (over every data-parallel rank of every replica group)."""
    window.lr = current_lr(run.optimization.optimizer)  # the lr this step ran at
    run.optimization.lr_scheduler.step()
    if first:  # compiled and warmed up: the tight timeout
        start_training_timeout(run.config.comm, run.state.step, run.info.world_size)
    for converter in run.model.converters:
        for part in run.model.parts:
            converter.post_optimizer_hook(part)
    if run.optimization.qk_clip is not None:  # MuonClip: the heads over tau shrink (or a monitor)
        window.max_logit = run.optimization.qk_clip.clip_()
    if window.experts:
        window.experts.after_step()
    tokens = run.batch.rank_tokens
    run.state.tokens_seen += tokens * run.dims.dp_degree * run.coordinator.groups()
    window.timer.tokens += tokens
    window.timer.steps += 1


def build_qk_clip(config, parts, dims) -> QKClip | None:
    """QK-Clip over the model's attention layers when [optimizer.muon] qk_clip_tau is set, a
    record-only one for [metrics] max_attention_logit: the heads' maxima reduced over the
    data-parallel ranks and gathered over tensor parallel's, the reported one over the
    pipeline's stages too."""
    tau = config.optimizer.muon.qk_clip_tau
    if not tau and not config.metrics.max_attention_logit:
        return None
    return QKClip(
        parts,
        tau or None,
        tp_mesh=dims.mesh("tp") if dims.tp_enabled else None,
        reduce_meshes=[dims.mesh("dp") if dims.dp_enabled else None],
        report_mesh=dims.mesh("pp") if dims.pp_enabled else None,
    )


def build_evaluator(run: Run) -> TaskEvaluator:
    """`[eval] tasks`, read and tokenized (their problems raised before the first step)."""
    config, dims = run.config, run.dims
    tokenizer = run.data.tokenizer
    tasks = load_tasks(config.eval, tokenizer, config.training.seq_len)
    dp_rank, dp_world = dp_coordinates(dims)
    return TaskEvaluator(
        config.eval,
        tasks,
        pad_id=tokenizer.pad_id,
        seq_len=config.training.seq_len,
        fixed_shape=dims.pp_enabled or dims.cp_enabled or config.compile.enable,
        pp_rows=config.training.local_batch_size if dims.pp_enabled else 0,
        dp_rank=dp_rank,
        dp_world=dp_world,
        cp=dims.cp,
    )


def build_validator(run: Run) -> Validator:
    dp_rank, dp_world = dp_coordinates(run.dims)
    return Validator(
        run.config.validation,
        run.data.spec,
        run.config.training.data_plugin,
        run.data.tokenizer,
        dp_rank,
        dp_world,
        run.config.training.seq_len,
        run.config.training.bad_rows,
    )
