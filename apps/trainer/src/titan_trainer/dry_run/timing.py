"""How good is the dry run's predicted step time? Predicted versus measured on CPU gloo
process groups (`bench/step_time_cpu.py`, `apps/trainer/tests/test_step_time_cpu.py`).

`measure_step_seconds` runs the trainer's own build and training step (the pieces
`titan_trainer.dry_run.simulate.measure_rank` runs, without its memory tracker) in
`world_size` real gloo processes of one thread each, and times whole optimizer steps: per step
the slowest rank's, the median over the steps after a warm-up; it also measures the cores the
processes had meanwhile (a machine shared with other work gives them fewer), which the
prediction's system takes (`measured_cpu_system(processes, free=...)`). `predicted_step_seconds`
simulates every rank role on fake tensors (CPU kernels) and prices them on a system
(`titan_trainer.dry_run.cpu_system.measured_cpu_system` for this machine).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_core import init_logging, load_config
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.hardware import System
from titan_trainer.dry_run.simulate import (
    Simulation,
    _create_optimizer_state,
    _simulation_config,
    _step_fn,
    build_rank,
    fresh_processes,
    rank_roles,
    simulate_rank,
)
from titan_trainer.dry_run.step_report import JobPrediction, predict_job

# The validated layouts (`bench/step_time_cpu.py`): world size and flags.
_PAR = "--parallelism."
_ONE_SHARD = [f"{_PAR}data_parallel_shard_degree", "1"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "FSDP 4": (4, []),
    "TP 2": (2, [f"{_PAR}tensor_parallel_degree", "2", *_ONE_SHARD]),
    "PP 2 (1F1B)": (2, [f"{_PAR}pipeline_parallel_degree", "2", *_ONE_SHARD]),
    "PP 2 (GPipe)": (
        2,
        [f"{_PAR}pipeline_parallel_degree", "2", f"{_PAR}pipeline_parallel_schedule", "GPipe"]
        + _ONE_SHARD,
    ),
    "CP 2": (2, [f"{_PAR}context_parallel_degree", "2", *_ONE_SHARD]),
    "FSDP 2 x TP 2": (4, [f"{_PAR}tensor_parallel_degree", "2"]),
}

# (flavor, seq_len, local batch, timed steps, warm-up steps): the debug model, and Llama 3's
# 100M flavor (~104M parameters besides the byte vocabulary's embedding) at a batch one thread
# steps in seconds.
MODELS = {"debug": ("debugmodel", 512, 8, 5, 2), "100M": ("100M", 512, 2, 3, 1)}


def model_config(model: str, extra: list[str]) -> JobConfig:
    """The job of `model` (a key of MODELS) in fp32 without activation checkpointing, with a
    layout's flags."""
    flavor, seq_len, batch, *_ = MODELS[model]
    return load_config(
        JobConfig,
        [
            *("--model.flavor", flavor, "--training.seq_len", str(seq_len)),
            *("--training.local_batch_size", str(batch)),
            *("--training.mixed_precision_param", "float32"),
            *("--activation_checkpoint.mode", "none"),
            *extra,
        ],
    )


@dataclass
class StepMeasurement:
    seconds: float
    """Per step the slowest rank's seconds, the median over the timed steps."""
    step_times: dict[int, list[float]]
    """Each rank's seconds for each timed step."""
    free_cores: float
    """The cores the job's processes had over the timed steps: the machine's, less what other
    processes kept busy meanwhile (all busy time by /proc/stat less the ranks' own CPU time);
    the machine's cores where /proc/stat cannot be read."""


def measure_step_seconds(
    config: JobConfig, world_size: int, vocab_size: int, steps: int = 6, warmup: int = 2
) -> float:
    """Seconds per training step of `config` on `world_size` one-thread gloo processes: for
    each of `steps` steps after `warmup` the slowest rank's time, the median over the steps."""
    return measure_step(config, world_size, vocab_size, steps, warmup).seconds


def measure_step(
    config: JobConfig, world_size: int, vocab_size: int, steps: int = 6, warmup: int = 2
) -> StepMeasurement:
    """`measure_step_seconds`, with each rank's step times and the cores the job had."""
    config.parallelism.build_parallel_dims(world_size)  # a bad layout fails here
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world_size, config, vocab_size, tmp, steps, warmup),
            nprocs=world_size,
            start_method=fresh_processes().get_start_method(),
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]
    times = {r: ranks[r]["times"] for r in range(world_size)}
    seconds = statistics.median(max(ts) for ts in zip(*times.values(), strict=True))
    cores = os.cpu_count() or 1
    free = float(cores)
    stat, wall = ranks[0]["stat"], ranks[0]["wall"]
    if stat is not None and stat[1] > 0 and wall > 0:
        busy = cores * stat[0] / stat[1]  # cores busy on average, these ranks included
        own = sum(r["cpu"] for r in ranks) / wall
        free = min(float(cores), max(1.0, cores - max(0.0, busy - own)))
    return StepMeasurement(seconds, times, free)


def _cpu_stat() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def simulate_for_cpu(config: JobConfig, world_size: int, vocab_size: int) -> Simulation:
    """Every rank role simulated on fake tensors with the CPU's kernels."""
    start = time.perf_counter()
    roles = [
        simulate_rank(config, world_size, rank, vocab_size, role, kernels="cpu")
        for role, rank in rank_roles(config, world_size)
    ]
    return Simulation(config, world_size, vocab_size, roles, time.perf_counter() - start)


def predicted_step_seconds(
    config: JobConfig, world_size: int, vocab_size: int, system: System
) -> float:
    """The dry run's predicted step of `config` on `world_size` ranks, priced on `system`."""
    return predict_cpu_job(simulate_for_cpu(config, world_size, vocab_size), system).step


def predict_cpu_job(sim: Simulation, system: System) -> JobPrediction:
    job = predict_job(sim, system)
    if job is None:
        raise RuntimeError("the simulation recorded no step work")
    return job


def _worker(
    rank: int,
    world_size: int,
    config: JobConfig,
    vocab_size: int,
    tmp: str,
    steps: int,
    warmup: int,
) -> None:
    init_logging(rank=rank)
    # One thread per process, as the measured system's single-thread peak assumes (the env
    # variable is read only when torch loads; this process has it loaded already).
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size
    )
    try:
        step = _build_step(config, world_size, vocab_size)
        for _ in range(warmup):
            step()
        times = []
        dist.barrier()
        stat, cpu, wall = _cpu_stat(), time.process_time(), time.perf_counter()
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        dist.barrier()
        end = _cpu_stat()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        busy = None if stat is None or end is None else [end[0] - stat[0], end[1] - stat[1]]
        Path(tmp, f"rank{rank}.json").write_text(
            json.dumps({"times": times, "cpu": cpu, "wall": wall, "stat": busy})
        )
    finally:
        dist.destroy_process_group()


def _build_step(config: JobConfig, world_size: int, vocab_size: int):
    """The trainer's build, initialisation, optimizer and step of this rank, on real tensors
    (as `measure_rank(fake=False)` builds them, without the memory tracker)."""
    from titan_trainer.optimizer import build_optimizer

    config = _simulation_config(config)
    dims, runtime, parts = build_rank(config, world_size, vocab_size, fake=False)
    runtime.materialize(parts)
    runtime.init_weights(parts)
    optimizer = build_optimizer(
        parts, config.optimizer, total_steps=config.training.steps, dims=dims
    )
    _create_optimizer_state(parts, optimizer)
    return _step_fn(config, runtime, parts, optimizer, vocab_size)
