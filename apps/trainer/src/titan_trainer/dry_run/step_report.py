"""The dry run's step-time block: each rank role's simulated step priced on a system
(`titan_trainer.dry_run.step_time`), said as predictions."""

from __future__ import annotations

from dataclasses import dataclass

from titan_trainer.batch import BatchShape
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.hardware import System, auto_system, load_system
from titan_trainer.dry_run.simulate import Simulation
from titan_trainer.dry_run.step_time import JobShape, Prediction, predict

FLOAT8 = "quantize.linear.float8"


@dataclass
class JobPrediction:
    system: System
    shape: JobShape
    roles: list[Prediction]
    flops_per_token: float

    @property
    def slowest(self) -> Prediction:
        return max(self.roles, key=lambda p: p.step)

    @property
    def step(self) -> float:
        """The job's step: its slowest rank role's (pipeline stages wait for each other)."""
        return self.slowest.step

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.shape.tokens_per_step / self.step / self.shape.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: the model's FLOPs per token at this rate over the peak."""
        peak = self.slowest.peak
        return self.tokens_per_second_per_device * self.flops_per_token / peak


def job_shape(
    config: JobConfig, world_size: int, stages_on_rank: int = 1, cp_style=None
) -> JobShape:
    p = config.parallelism
    dims = p.build_parallel_dims(world_size)
    batch = BatchShape.of(config.training, dims.dp_degree)
    degrees = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "ep": dims.ep,
    }
    return JobShape(
        degrees=degrees,
        tokens_per_step=batch.global_size * batch.seq_len,
        world_size=world_size,
        schedule=p.pipeline_parallel_schedule,
        pp_microbatches=max(
            1, config.training.local_batch_size // p.pipeline_parallel_microbatch_size
        ),
        stages_per_rank=stages_on_rank,
        async_tp=p.enable_async_tensor_parallel,
        cp_style=cp_style,
    )


def predict_job(
    sim: Simulation, system: System, cp_style: str | None = None
) -> JobPrediction | None:
    """Every rank role's predicted step; None when the simulation recorded no work."""
    if any(r.trace is None for r in sim.roles):
        return None
    stages = max(r.stages_on_rank for r in sim.roles)
    shape = job_shape(sim.config, sim.world_size, stages, cp_style)
    roles = [predict(r.role, r.trace, shape, system) for r in sim.roles]
    return JobPrediction(system, shape, roles, sim.roles[0].flops_per_token)


def system_for(config: JobConfig, world_size: int = 1) -> System | None:
    """The system `[dry_run] system` names (`cpu`: measured for `world_size` ranks on this
    machine); None for `auto` on a device none describes."""
    d = config.dry_run
    if d.system == "auto" and auto_system(d.device) is None:
        return None
    if d.system == "cpu":
        from titan_trainer.dry_run.cpu_system import measured_cpu_system_elsewhere

        return measured_cpu_system_elsewhere(world_size)
    return load_system(d.system, d.device)


def step_time_block(job: JobPrediction) -> str:
    """The lines the dry run prints; every figure is labelled a prediction."""
    s = job.system
    lines = [
        f"predicted step time on {s.name} (a model, not a measurement: docs/step_time.md)",
        f"{'rank role':<20}{'step s':>10}{'compute':>10}{'exposed comm':>14}{'bubble':>9}"
        f"{'all comm s':>12}   (predicted)",
    ]
    for p in job.roles:
        lines.append(
            f"{p.role:<20}{p.step:>10.4g}{p.share('compute'):>10.0%}{p.share('exposed'):>14.0%}"
            f"{p.share('bubble'):>9.0%}{p.communication:>12.3f}"
        )
    comm = ", ".join(f"{g} {t:.3f} s" for g, t in sorted(job.slowest.by_group.items()))
    lines.append(
        f"predicted: {job.step:.4g} s per step, {job.tokens_per_second_per_device:,.0f} tokens/s"
        f" per device, MFU {job.mfu:.1%}" + (f" (communication by group: {comm})" if comm else "")
    )
    return "\n".join(lines)
