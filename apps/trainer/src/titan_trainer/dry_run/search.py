"""`--dry_run.search`: the layouts of this job's world size that fit, ranked by predicted
tokens/s per device.

The search runs in two rounds, every candidate simulated as the dry run simulates the job
itself (its real size, fake tensors) and priced on the same system:

1. degrees: every split of the world size into TP (up to a node, dividing the heads), PP
   (dividing the layers) and CP (long sequences only), FSDP taking the rest, with the job's own
   activation checkpointing, schedule and numerics;
2. around the best that fit: each activation checkpointing mode, Float8 linears (on a system
   with an FP8 peak), and under PP the other schedule and twice the microbatches.

Each line of the answer says its predicted tokens/s and MFU, its memory, and where its time
goes (compute, exposed communication, bubble): why it wins or loses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from titan_core import Progress
from titan_parallel.memory_estimate import GiB
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.hardware import System
from titan_trainer.dry_run.simulate import simulate
from titan_trainer.dry_run.step_report import FLOAT8, JobPrediction, predict_job
from titan_trainer.layout import layout_text
from titan_trainer.model import model_spec
from titan_trainer.preflight import preflight_problems

LONG_SEQUENCE = 32768
"""From this sequence length on, context parallel degrees are candidates too."""


@dataclass
class Candidate:
    label: str
    config: JobConfig
    job: JobPrediction | None = None
    peak_gib: float = 0.0
    fits: bool = False
    problem: str | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_candidates(config: JobConfig, world: int, devices_per_node: int) -> list[Candidate]:
    """Round 1: every (TP, PP, CP) split of `world`, FSDP taking the rest."""
    flavor = model_spec(config).flavors[config.model.flavor]
    heads = getattr(flavor, "n_heads", None) or 1
    layers = getattr(flavor, "n_layers", None) or 1
    cps = [1, 2, 4, 8] if config.training.seq_len >= LONG_SEQUENCE else [1]
    out = []
    for tp in _divisors(world):
        if tp > devices_per_node or heads % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and (layers < 2 * pp or pp > 16):
                continue
            for cp in cps:
                if (world // tp // pp) % cp:
                    continue
                out.append(_with_degrees(config, world, tp, pp, cp))
    return out


def _with_degrees(config: JobConfig, world: int, tp: int, pp: int, cp: int) -> Candidate:
    changed = copy.deepcopy(config)
    p = changed.parallelism
    p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree = tp, pp, cp
    p.data_parallel_replicate_degree = 1
    p.data_parallel_shard_degree = world // (tp * pp * cp)
    if pp > 1 and config.parallelism.pipeline_parallel_degree == 1:
        p.pipeline_parallel_microbatch_size = 1
        if changed.training.local_batch_size < pp:
            changed.training.local_batch_size = pp  # a microbatch per stage at least
    return Candidate(_label(changed, world), changed)


def _label(config: JobConfig, world: int) -> str:
    dims = config.parallelism.build_parallel_dims(world)
    parts = [layout_text(dims)]
    if dims.pp_enabled:
        m = config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
        parts.append(f"{config.parallelism.pipeline_parallel_schedule} x {m} microbatches")
    parts.append(f"AC {config.activation_checkpoint.mode}")
    if FLOAT8 in config.model.converters:
        parts.append("Float8")
    parts.append(f"local batch {config.training.local_batch_size}")
    return ", ".join(parts)


def variations(best: Candidate, world: int, system: System) -> list[Candidate]:
    """Round 2 around one good layout: AC modes, Float8, the other schedule, more
    microbatches."""
    base = best.config
    out = []

    def vary(change: Callable[[JobConfig], None]) -> None:
        changed = copy.deepcopy(base)
        change(changed)
        out.append(Candidate(_label(changed, world), changed))

    for mode in ("none", "selective", "full"):
        if mode != base.activation_checkpoint.mode:
            vary(lambda c, m=mode: setattr(c.activation_checkpoint, "mode", m))
    if "fp8" in system.peak_tflops and FLOAT8 not in base.model.converters:
        vary(lambda c: setattr(c.model, "converters", [*c.model.converters, FLOAT8]))
    if base.parallelism.pipeline_parallel_degree > 1:
        other = (
            "Interleaved1F1B" if base.parallelism.pipeline_parallel_schedule == "1F1B" else "1F1B"
        )
        vary(lambda c: setattr(c.parallelism, "pipeline_parallel_schedule", other))
        vary(lambda c: setattr(c.training, "local_batch_size", 2 * c.training.local_batch_size))
    return out


def evaluate(
    candidate: Candidate, world: int, vocab_size: int, system: System, capacity: float, headroom
) -> Candidate:
    problems, _, _ = preflight_problems(candidate.config, world, dry_run=True)
    if problems:
        candidate.problem = problems[0].splitlines()[0]
        return candidate
    sim = simulate(candidate.config, world, vocab_size)
    candidate.peak_gib = sim.worst.peak / GiB
    candidate.fits = candidate.peak_gib + headroom <= capacity
    candidate.job = predict_job(sim, system)
    return candidate


def search_layouts(
    config: JobConfig,
    world: int,
    vocab_size: int,
    system: System,
    capacity: float,
    out,
    top: int = 5,
    keep: int = 2,
) -> list[Candidate]:
    """Both rounds; prints the ranking and returns every candidate that fit, best first."""
    headroom = config.dry_run.headroom_gib
    first = degree_candidates(config, world, system.devices_per_node)
    out(f"search: {len(first)} splits of {world} ranks, then variations of the best {keep}")
    progress = Progress("dry run: search", len(first))
    seen: dict[str, Candidate] = {}
    for candidate in first:
        progress.say(f"simulating {candidate.label}")
        seen[candidate.label] = evaluate(candidate, world, vocab_size, system, capacity, headroom)
        progress.done(candidate.label)
    for best in _ranked(seen.values())[:keep]:
        for candidate in variations(best, world, system):
            if candidate.label not in seen:
                seen[candidate.label] = evaluate(
                    candidate, world, vocab_size, system, capacity, headroom
                )
    ranked = _ranked(seen.values())
    out(f"layouts that fit, by predicted tokens/s per device on {system.name} (predicted):")
    for i, c in enumerate(ranked[:top], 1):
        out(f"  {i}. {c.label}: {_why(c, ranked[0])}")
    refused = [c for c in seen.values() if not c.fits]
    if refused:
        out(f"  ({len(refused)} other candidates do not fit or cannot run here)")
    if not ranked:
        out("  none fits: see the changes suggested above")
    return ranked


def _ranked(candidates) -> list[Candidate]:
    fitting = [c for c in candidates if c.fits and c.job is not None]
    return sorted(fitting, key=lambda c: -c.job.tokens_per_second_per_device)


def _why(c: Candidate, best: Candidate) -> str:
    job = c.job
    slowest = job.slowest
    text = (
        f"{job.tokens_per_second_per_device:,.0f} tokens/s, MFU {job.mfu:.1%}, peak"
        f" {c.peak_gib:.1f} GiB; step {job.step:.3g} s = compute {slowest.share('compute'):.0%}"
        f" + exposed communication {slowest.share('exposed'):.0%}"
        f" + bubble {slowest.share('bubble'):.0%}"
    )
    if c is not best:
        ratio = job.tokens_per_second_per_device / best.job.tokens_per_second_per_device
        text += f" ({ratio:.0%} of the best)"
    return text
