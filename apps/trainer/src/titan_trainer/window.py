"""The metric line: what the steps since the last logged one did (loss, gradient norm, learning
rate, throughput, MFU, memory, data time, skipped rows and steps, expert load, replica groups),
read back from the device once per logged step, and the validation loss when it is due."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from titan_core import MemoryMonitor, ParallelDims, config_to_dict, get_logger, peak_flops
from titan_trainer.data import skipped_rows_total
from titan_trainer.downstream import TaskEvaluator, report
from titan_trainer.experts import ExpertLoad
from titan_trainer.guards import StepGuard
from titan_trainer.metrics import MetricsLogger, StepTimer
from titan_trainer.run import Run
from titan_trainer.step import pipeline_microbatches
from titan_trainer.validate import Validator

log = get_logger("train")


@dataclass
class MetricWindow:
    """What the metric line of one logging window is computed from."""

    metrics: MetricsLogger
    timer: StepTimer
    memory: MemoryMonitor
    peak_flops: float
    flops_per_token: float
    experts: ExpertLoad
    lr: float = 0.0
    """The learning rate the last step ran at (the optimizer holds the next step's)."""
    max_logit: torch.Tensor | None = None
    """The last step's largest attention logit, when QK-Clip is on (a device tensor)."""


def open_window(run: Run) -> MetricWindow:
    """The metric writers, the step timer, the memory monitor and the device's peak (logged
    once, with the microbatches per step)."""
    config, runtime, accum = run.config, run.model.runtime, run.batch.accumulation
    peak = peak_flops(run.info.device, runtime.dtype, override_tflops=config.metrics.peak_tflops)
    log.info("peak %s; %d microbatch(es) per step", peak.describe(), accum)
    return MetricWindow(
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
            section=config.metrics,
        ),
        StepTimer(),
        MemoryMonitor(run.info.device),
        peak.flops,
        runtime.flops_per_token,
        # Each forward adds its auxiliary balance loss: weigh it by the forwards per step
        # (accumulated microbatches, and the pipeline's microbatches within each).
        ExpertLoad(run.model.parts, run.dims, accum * pipeline_microbatches(runtime)),
    )


def log_window(run: Run, window: MetricWindow, guard: StepGuard) -> None:
    """One metric line for the steps since the last one: the one read-back of their values
    (it raises if a step was not finite)."""
    rows = guard.read()
    run.state.losses.extend(row[1] for row in rows)
    _, loss, grad_norm = rows[-1]
    values = window_metrics(window, loss, grad_norm, run.dims)
    loader = run.data.loader
    values["skipped_rows"] = skipped_rows_total(loader, run.dims.mesh("dp"), run.info.device)
    by_source = loader.tokens_by_source
    if len(by_source) > 1:  # a mixture: tokens the whole job took from each
        values.update({f"tokens/{label}": float(n) for label, n in by_source.items()})
    values["skipped_steps"] = guard.skipped
    if (load := window.experts.read()) is not None:  # the worst layer, then each layer
        values["expert_load"] = max(load.values())
        values.update({f"expert_load/{name}": ratio for name, ratio in load.items()})
    if (rerouted := window.experts.read_rerouted()) is not None:  # under a capacity
        values["expert_rerouted_pct"] = 100 * max(rerouted.values())
        values.update({f"expert_rerouted_pct/{n}": 100 * v for n, v in rerouted.items()})
    if window.max_logit is not None:
        values["max_logit"] = float(window.max_logit)
    values.update(run.coordinator.metrics())
    window.metrics.log(run.state.step, values)
    window.timer.reset()


def window_metrics(window: MetricWindow, loss, grad_norm, dims: ParallelDims) -> dict[str, float]:
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


def validate(run: Run, window: MetricWindow, validator: Validator) -> None:
    loss = validator.run(run.model.runtime, run.model.parts)
    log.info("step %4d | validation loss %.4f", run.state.step, loss)
    window.metrics.log_scalars(run.state.step, {"validation_loss": loss})
    window.timer.reset()  # validation time is not training throughput


def evaluate_if_due(
    run: Run,
    window: MetricWindow,
    validator: Validator | None,
    evaluator: TaskEvaluator | None,
    *,
    last: bool,
) -> None:
    """The validation loss and the downstream tasks, each when due (both after the last step)."""
    step = run.state.step
    if validator is not None and (validator.due(step) or last):
        validate(run, window, validator)
    if evaluator is not None and evaluator.due(step, last):
        evaluate(run, window, evaluator)


def evaluate(run: Run, window: MetricWindow, evaluator: TaskEvaluator) -> None:
    results = evaluator.run(run.model.runtime, run.model.parts)
    report(results, run.state.step, window.metrics, run.dump, run.info.rank, run.state.run_id)
    window.timer.reset()  # evaluation time is not training throughput
