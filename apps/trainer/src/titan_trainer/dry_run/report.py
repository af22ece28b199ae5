"""The dry run's answer: the job's world size, the checks of `titan_trainer.preflight`, the
simulation of each rank role (`titan_trainer.dry_run.simulate`), the table of memory per rank
role, the fit verdict against the target device, whether the checkpoint it would resume from
loads, and changes that make it fit when it does not (`titan_trainer.dry_run.suggest`).

Exit status: 0 the job fits, 2 a config problem, 3 it does not fit.
"""

from __future__ import annotations

import os
import sys

from titan_core import ConfigError, Progress, device_memory_gib
from titan_parallel.memory_estimate import GiB
from titan_trainer.checkpointing.resume import loadable_problems
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.hardware import load_system
from titan_trainer.dry_run.simulate import (
    Simulation,
    fork_simulations_from_here,
    rank_roles,
    simulate,
)
from titan_trainer.dry_run.step_report import predict_job, step_time_block, system_for
from titan_trainer.dry_run.suggest import suggest_changes
from titan_trainer.dry_run.text import gib_text
from titan_trainer.layout import layout_text
from titan_trainer.memory_modes import ac_text, dtype_text, memory_mode_notes
from titan_trainer.preflight import preflight

EXIT_FITS, EXIT_CONFIG, EXIT_DOES_NOT_FIT = 0, 2, 3


DEFAULT_WORLD_SIZE = 8
"""The world size of a job whose degrees leave it open (data_parallel_shard_degree = -1) and
that names none: one node of 8 GPUs, as torchtitan's launcher (NGPU=8) and its TOML files
assume."""


def resolve_world_size(config: JobConfig) -> tuple[int, str | None]:
    """(the world size to simulate, a note when it was not given): `dry_run.world_size`,
    else the product of the degrees when none is -1, else NGPU, else the smallest multiple of
    the fixed degrees from DEFAULT_WORLD_SIZE up."""
    if config.dry_run.world_size is not None:
        return config.dry_run.world_size, None
    world_size = config.parallelism.job_world_size()
    if world_size is not None:
        return world_size, None
    if os.environ.get("NGPU", "").isdigit():
        return int(os.environ["NGPU"]), None
    p = config.parallelism
    fixed = (
        p.data_parallel_replicate_degree
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )
    world_size = -(-DEFAULT_WORLD_SIZE // fixed) * fixed
    return world_size, (
        f"world size {world_size}: data_parallel_shard_degree = -1 takes what the job's processes"
        f" leave, and neither [dry_run] world_size nor NGPU names them, so one node of"
        f" {DEFAULT_WORLD_SIZE} GPUs is assumed, as torchtitan's launcher does"
        + (
            f" (rounded up to a multiple of the other degrees, {fixed})"
            if world_size != DEFAULT_WORLD_SIZE
            else ""
        )
        + "; --dry_run.world_size N (or NGPU=N) simulates another"
    )


def device_capacity_gib(config: JobConfig) -> tuple[float, str]:
    d = config.dry_run
    if d.device_memory_gib is not None:
        return (
            d.device_memory_gib,
            f"{d.device_memory_gib:g} GiB devices (dry_run.device_memory_gib)",
        )
    gib = device_memory_gib(d.device)
    if gib is None:
        raise ConfigError(
            f"[dry_run] device = {d.device!r} is not a device whose memory Titan knows\n"
            "name one of H100, H200, A100, A100-40GB, B200, GB200, MI300X, ... "
            "or set dry_run.device_memory_gib"
        )
    return gib, f"{d.device} ({gib:g} GiB)"


def fits(sim: Simulation, capacity_gib: float, headroom_gib: float) -> bool:
    return sim.worst.peak / GiB + headroom_gib <= capacity_gib


def dry_run(config: JobConfig, out=print) -> int:
    """Check, simulate and report; the exit status (see the module docstring)."""
    world_size, assumed = resolve_world_size(config)
    try:
        capacity, capacity_text = device_capacity_gib(config)
    except ConfigError as e:
        out(e.render())
        return EXIT_CONFIG
    checked = preflight(config, world_size, dry_run=True)
    problems, notes, vocab_size = checked.problems, checked.notes, checked.vocab_size
    if config.dry_run.system not in ("auto", "cpu"):
        try:  # a bad system file is named before minutes of simulation, not after
            load_system(config.dry_run.system)
        except ConfigError as e:
            problems = [*problems, *e.problems]
    if problems:
        out(ConfigError(problems).render())
        return EXIT_CONFIG

    cp_style = checked.layout.cp_style() if checked.layout is not None else None
    out(_header(config, world_size, capacity_text, cp_style))
    if assumed is not None:
        out(f"note: {assumed}")
    try:
        roles = len(rank_roles(config, world_size))
        sim = simulate(config, world_size, vocab_size, progress=Progress("dry run", roles))
    except ConfigError as e:  # found only once the model meets its layout: said as the others
        out(e.render())
        return EXIT_CONFIG
    expected: dict[str, tuple[int, ...]] = {}
    for role in sim.roles:
        expected.update(role.checkpoint_shapes)
    problems += checked.here + loadable_problems(config, expected, notes)
    out(_table(sim))
    block = predicted_step_block(config, sim, cp_style)
    if block:
        out(block)
    headroom = config.dry_run.headroom_gib
    ok = fits(sim, capacity, headroom)
    out(_verdict(sim, capacity, headroom, ok, problems))
    for note in [*notes, *memory_mode_notes(config, sim.worst.offloaded)]:
        out(f"note: {note}")
    out(f"simulated {len(sim.roles)} rank role(s) in {sim.seconds:.0f} s")
    if config.dry_run.search:
        run_search(config, world_size, vocab_size, capacity, out)
    if problems:
        out(ConfigError(problems).render())
        return EXIT_CONFIG
    if not ok:
        if config.dry_run.suggest:
            out("changes that make it fit (cheapest first), each simulated:")
            suggest_changes(config, sim, capacity, headroom, out)
        return EXIT_DOES_NOT_FIT
    return EXIT_FITS


def predicted_step_block(config: JobConfig, sim: Simulation, cp_style: str | None) -> str | None:
    """The step-time block, or a note saying why there is none."""
    try:
        system = system_for(config, sim.world_size)
    except ConfigError as e:
        return f"note: no predicted step time: {first_line(e.problems[0])}"
    if system is None:
        return (
            f"note: no predicted step time: no shipped system describes {config.dry_run.device}"
            "; set [dry_run] system to a TOML file describing it (docs/step_time.md)"
        )
    job = predict_job(sim, system, cp_style)
    return None if job is None else step_time_block(job)


def run_search(config: JobConfig, world_size: int, vocab_size: int, capacity: float, out) -> None:
    """`--dry_run.search`: the layouts that fit, ranked (`titan_trainer.dry_run.search`)."""
    from titan_trainer.dry_run.search import search_layouts

    system = system_for(config, world_size)
    if system is None:
        out(
            f"search: no system describes {config.dry_run.device}; set [dry_run] system"
            " (docs/step_time.md) to rank layouts by speed"
        )
        return
    search_layouts(config, world_size, vocab_size, system, capacity, out)


def _verdict(
    sim: Simulation, capacity: float, headroom: float, ok: bool, problems: list[str]
) -> str:
    """One line: whether the job fits in memory, and every other reason a launch of it from
    here would stop (the problems, whose fixes follow the notes)."""
    worst = sim.worst.peak / GiB
    peak = f"peak {worst:.1f} GiB + {headroom:g} GiB headroom of {capacity:g} GiB"
    if ok:
        memory = f"fits, {capacity - worst - headroom:.1f} GiB free on the fullest rank ({peak})"
    else:
        memory = f"does not fit by {gib_text(worst + headroom - capacity)} GiB ({peak})"
    if not problems:
        return f"verdict: {memory}"
    reasons = "; ".join(first_line(p) for p in problems)
    if ok:
        return f"verdict: does not start: memory {memory.replace('fits, ', 'fits, with ', 1)}, but {reasons}"
    return f"verdict: {memory}; and {reasons}"


def first_line(problem: str) -> str:
    return problem.splitlines()[0]


def _header(
    config: JobConfig, world_size: int, capacity_text: str, cp_style: str | None = None
) -> str:
    dims = config.parallelism.build_parallel_dims(world_size)
    t = config.training
    dtype = dtype_text(t)
    extra = [ac_text(config.activation_checkpoint)]
    if config.model.converters:
        extra.append(", ".join(config.model.converters))
    if dims.pp_enabled:
        extra.append(f"{config.parallelism.pipeline_parallel_schedule} schedule")
    if config.model.attn_mask_type == "block_causal":
        extra.append("packed documents")
    compiled = (
        f"; compiled code as {config.compile.backend} runs it" if config.compile.enable else ""
    )
    return (
        f"titan dry run: {config.model.name} {config.model.flavor} on {world_size} x {capacity_text}\n"
        f"layout {layout_text(dims, cp_style)} | seq {t.seq_len} | local batch {t.local_batch_size}"
        f" | {dtype} | {' | '.join(extra)}\n"
        f"simulated on fake tensors of the real size (no memory used){compiled}"
    )


def _table(sim: Simulation) -> str:
    cols = ("parameters", "gradients", "optimizer", "activations", "temporaries", "communication")
    head = (
        f"{'rank role':<20}"
        + "".join(f"{c[:11]:>12}" for c in cols)
        + f"{'step peak':>12}{'init peak':>12}"
    )
    lines = [head + "   (GiB)"]
    for r in sim.roles:
        values = r.step.gib()
        lines.append(
            f"{r.role:<20}"
            + "".join(f"{values[c]:>12.2f}" for c in cols)
            + f"{r.step.total / GiB:>12.2f}{r.init_peak / GiB:>12.2f}"
        )
    return "\n".join(lines)


def main_dry_run(config: JobConfig, *, own_process: bool = False) -> int:
    """`titan-train --dry-run`. `own_process`: this process is the command's own and has only
    loaded the config, so the simulations fork from it (see `fork_simulations_from_here`); a
    caller in a process where more has run (autograd's threads, a process group) leaves it
    off."""
    if own_process:
        fork_simulations_from_here()
    status = dry_run(config, out=lambda text: print(text, flush=True))
    sys.stdout.flush()
    return status
