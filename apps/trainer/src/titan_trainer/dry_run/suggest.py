"""When a job does not fit: the changes that would make it fit, each simulated.

Candidates are tried in order of what they cost the run (recomputation first, then numerics,
then smaller steps, then more communication: expert parallel for mixture-of-experts models,
then TP and CP; then more GPUs); each one that is valid for this model and layout is simulated
on the rank that needed the most memory, and reported with its own peak.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from titan_core import PluginError, Progress
from titan_parallel.memory_estimate import GiB
from titan_trainer.batch import BatchShape
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.simulate import simulate_rank
from titan_trainer.dry_run.text import gib_text
from titan_trainer.model import model_spec
from titan_trainer.preflight import preflight_problems

FLOAT8 = "quantize.linear.float8"


@dataclass(frozen=True)
class Change:
    label: str
    apply: Callable[[JobConfig, int], tuple[JobConfig, int] | None]
    """(changed config, world size), or None when the change does not apply here."""


def _ac(mode: str, option: str = "op") -> Callable:
    order = {"none": 0, "selective": 1, "full": 2}

    def apply(config: JobConfig, world: int):
        current = config.activation_checkpoint
        if order[current.mode] >= order[mode]:
            return None
        changed = copy.deepcopy(config)
        changed.activation_checkpoint.mode = mode
        changed.activation_checkpoint.selective_ac_option = option
        return changed, world

    return apply


def _float8(config: JobConfig, world: int):
    if FLOAT8 in config.model.converters:
        return None
    changed = copy.deepcopy(config)
    changed.model.converters = [*config.model.converters, FLOAT8]
    return changed, world


def _half_batch(config: JobConfig, world: int):
    t = config.training
    if t.local_batch_size < 2 or t.local_batch_size % 2:
        return None
    dims = config.parallelism.build_parallel_dims(world)
    changed = copy.deepcopy(config)
    changed.training.local_batch_size = t.local_batch_size // 2
    if t.global_batch_size == -1:  # keep the step's batch: accumulate two microbatches
        changed.training.global_batch_size = BatchShape.of(t, dims.dp_degree).global_size
    return changed, world


def _trade_shard_for(key: str) -> Callable:
    """Double tensor or context parallel, taking the ranks from FSDP (same world size)."""

    def apply(config: JobConfig, world: int):
        dims = config.parallelism.build_parallel_dims(world)
        if dims.dp_shard % 2:
            return None
        changed = copy.deepcopy(config)
        p = changed.parallelism
        setattr(p, key, getattr(p, key) * 2)
        p.data_parallel_shard_degree = dims.dp_shard // 2
        return changed, world

    return apply


def _more_expert_parallel(config: JobConfig, world: int):
    """Double expert parallel on a mixture-of-experts model: each rank holds half as many
    experts (same world size; EP borrows its ranks from FSDP's)."""
    try:
        flavor = model_spec(config).flavors[config.model.flavor]
    except (PluginError, KeyError):
        return None
    if flavor.moe is None:
        return None
    dims = config.parallelism.build_parallel_dims(world)
    changed = copy.deepcopy(config)
    changed.parallelism.expert_parallel_degree = dims.ep * 2
    return changed, world


def _more_gpus(config: JobConfig, world: int):
    dims = config.parallelism.build_parallel_dims(world)
    changed = copy.deepcopy(config)
    changed.parallelism.data_parallel_shard_degree = dims.dp_shard * 2
    return changed, world * 2


CHANGES = [
    Change("activation checkpointing: selective (op)", _ac("selective")),
    Change("activation checkpointing: full", _ac("full")),
    Change("Float8 linear layers (model.converters += quantize.linear.float8)", _float8),
    Change("half the local batch, same global batch (gradient accumulation)", _half_batch),
    Change("expert parallel x2 (each rank holds half the experts)", _more_expert_parallel),
    Change("tensor parallel x2 (from the FSDP degree)", _trade_shard_for("tensor_parallel_degree")),
    Change(
        "context parallel x2 (from the FSDP degree)", _trade_shard_for("context_parallel_degree")
    ),
    Change("twice the GPUs (FSDP degree x2)", _more_gpus),
]


def suggest_changes(config: JobConfig, sim, capacity_gib: float, headroom_gib: float, out) -> None:
    """Simulate each applicable change on the fullest rank role and print one line each."""
    worst = sim.worst
    pp_index = _pp_index(config, sim.world_size, worst.rank)
    best = None
    applicable = [(change, change.apply(config, sim.world_size)) for change in CHANGES]
    applicable = [(change, result) for change, result in applicable if result is not None]
    progress = Progress("dry run: changes", len(applicable))
    for change, (changed, world) in applicable:
        problems, _, _ = preflight_problems(changed, world, dry_run=True)
        if problems:
            out(f"  - {change.label}: not possible here ({problems[0].splitlines()[0]})")
            continue
        rank = pp_index * (world // changed.parallelism.build_parallel_dims(world).pp)
        progress.say(f"simulating {change.label} on {worst.role}")
        role = simulate_rank(changed, world, rank, sim.vocab_size, worst.role)
        progress.done(change.label)
        peak = role.peak / GiB
        free = capacity_gib - peak - headroom_gib
        verdict = f"fits, {free:.1f} GiB free" if free >= 0 else f"short by {gib_text(-free)} GiB"
        if role.peak >= worst.peak * 0.999:  # simulated with the change, which saved nothing
            verdict += f"; no lower than now: {_no_saving(change, config)}"
        out(f"  - {change.label}: peak {peak:.1f} GiB, {verdict}")
        if free >= 0 and best is None:
            best = change.label
    out(f"cheapest change that fits: {best}" if best else "no single change fits; combine them")


def _no_saving(change: Change, config: JobConfig) -> str:
    """Why a change that was simulated leaves the peak where it was."""
    ac = config.activation_checkpoint
    if change.apply is _float8 and ac.mode == "selective" and ac.selective_ac_option == "op":
        return (
            "Float8 runs the matmuls in 8 bits, but what the step keeps for backward stays in"
            " the compute dtype (selective op checkpointing keeps the matmuls' outputs)"
        )
    return "this change does not lower what the fullest rank holds at its peak"


def _pp_index(config: JobConfig, world: int, rank: int) -> int:
    dims = config.parallelism.build_parallel_dims(world)
    return rank // (world // dims.pp)
