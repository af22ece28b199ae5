"""One simulated rank of a job (`titan-train --dry-run`, torchtitan's `--comm.mode
fake_backend`), and every distinct rank role of it.

Each distinct rank role (every rank is alike without pipeline parallel; with it, the first and
last pipeline ranks, or all of them) is simulated in a process of its own: a fake process group
of the job's real world size, the model at its full size on fake tensors, the trainer's own
parallelize path (pipeline stages, TP, AC, FSDP, Float8, CP), its initialisation, optimizer and
one training step, measured by PyTorch's memory trackers (see
`titan_parallel.memory_estimate`). Compiled blocks and the compiled loss are traced and
partitioned as inductor does, their intermediates fused away as its kernels would (see
`titan_parallel.compiled_memory`); where CUDA's kernels keep less for backward than the CPU's,
the step follows CUDA (`titan_parallel.cuda_kernels`). Nothing is allocated, nothing is
downloaded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import gc
import importlib
import logging
import multiprocessing
import queue
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

import titan_parallel
from titan_core import (
    MemoryMonitor,
    ModelSpec,
    ParallelDims,
    Progress,
    init_logging,
    supports_bf16,
)
from titan_core.init import canonical_name
from titan_parallel.activation_offload import offloaded_bytes
from titan_parallel.compiled_memory import simulated_backend
from titan_parallel.cuda_kernels import cuda_kernels
from titan_parallel.memory_estimate import (
    GiB,
    MemoryBreakdown,
    estimate_init_memory,
    estimate_step_memory,
    fake_process_group,
    fake_tensors,
    resident_bytes,
)
from titan_trainer.batch import BatchShape
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.step_trace import StepTrace, StepWork, group_labels
from titan_trainer.layout import Layout
from titan_trainer.loss import cross_entropy_loss
from titan_trainer.model import build_converters, build_meta_model, build_model
from titan_trainer.optimizer import build_optimizer
from titan_trainer.precision import target_compute_dtype
from titan_trainer.runtime import ParallelRuntime, build_parallel_runtime


@dataclass
class RoleResult:
    """What one simulated rank needs."""

    role: str
    rank: int
    step: MemoryBreakdown
    init_peak: int
    checkpoint_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    offloaded: int = 0
    """Bytes of activations one step moves to host memory ([activation_checkpoint]
    cpu_offload; simulated GPU runs only)."""
    rss_peak: int | None = None
    """Measured runs only: the peak by the operating system's count: what persisted before the
    step plus how far the process's resident set rose during it."""
    trace: StepWork | None = None
    """The step's work, op by op summed (what `titan_trainer.dry_run.step_time` prices)."""
    flops_per_token: float = 0.0
    """The model's training FLOPs per token by its own count (MFU's numerator)."""
    stages_on_rank: int = 1
    """Pipeline stages this rank holds."""

    @property
    def peak(self) -> int:
        return max(self.step.total, self.init_peak)


@dataclass
class Simulation:
    config: JobConfig
    world_size: int
    vocab_size: int
    roles: list[RoleResult]
    seconds: float

    @property
    def worst(self) -> RoleResult:
        return max(self.roles, key=lambda r: r.peak)


# ----------------------------------------------------------------------------- one rank


def _simulation_config(config: JobConfig, *, real_compile: bool = False) -> JobConfig:
    """The config the simulation runs: compiled regions traced and partitioned as the compile
    backend does but run eagerly (see `titan_parallel.compiled_memory`; `real_compile` keeps
    the real backend), async TP off (CUDA only; its buffers are small)."""
    sim = copy.deepcopy(config)
    if not real_compile:
        sim.compile.backend = simulated_backend(config.compile.backend)
    sim.parallelism.enable_async_tensor_parallel = False
    return sim


def rank_roles(config: JobConfig, world_size: int) -> list[tuple[str, int]]:
    """(description, global rank) of each rank to simulate."""
    dims = config.parallelism.build_parallel_dims(world_size)
    if not dims.pp_enabled:
        return [("every rank", 0)]
    per_stage = world_size // dims.pp  # pp is the outermost mesh dimension
    pp_ranks = range(dims.pp) if config.dry_run.all_ranks else sorted({0, dims.pp - 1})
    return [(f"pipeline rank {p}", p * per_stage) for p in pp_ranks]


def simulate_rank(
    config: JobConfig,
    world_size: int,
    rank: int,
    vocab_size: int,
    role: str,
    *,
    kernels: Literal["cuda", "cpu"] = "cuda",
    phases: bool = False,
) -> RoleResult:
    """Build, initialise and step rank `rank` of the job on fake tensors; its memory.
    `kernels`: whose kernels' memory the step follows where CUDA's and the CPU's differ (see
    `titan_parallel.cuda_kernels`): the job's GPUs, or the CPU (to compare with a CPU run).
    With `phases`, each part that finishes is said on stderr (`dry run: ROLE: ...`).

    Runs in a fresh process: torch caches decisions about meshes and process groups (DTensor's
    redistribution plans) that would leak from one simulated rank into the next.
    """
    context = fresh_processes()
    # The simulation's own lines come back to this process, which says them: a process forked
    # from a server started earlier writes to whatever stderr that server had.
    lines = context.Queue() if phases else None
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=context, initializer=_send_phases_to, initargs=(lines,)
    ) as pool:
        future = pool.submit(
            _simulate_rank_here, config, world_size, rank, vocab_size, role, kernels, phases
        )
        finished = False
        while lines is not None:
            try:  # once the result is in, a last line may still be on its way: wait a little
                print(lines.get(timeout=1.0 if finished else 0.2), file=sys.stderr, flush=True)
            except queue.Empty:
                if finished:
                    break
                finished = future.done()
        return future.result()


_phase_lines = None
"""Where a simulation's process sends the lines that say its parts (a queue to the parent)."""


def _send_phases_to(lines) -> None:
    global _phase_lines
    _phase_lines = lines


def fresh_processes() -> multiprocessing.context.BaseContext:
    """Where each simulation runs: a new process forked from a server process that has
    imported torch and the trainer once (forkserver), so that a job's rank roles and the
    changes suggested for it pay that import once, not once each (several seconds each).
    Nothing has run in the server, so each simulation starts as fresh as a spawned one.
    Forked from this process itself once it has declared itself as fresh as that server
    (`fork_simulations_from_here`); spawned where forkserver does not exist (Windows)."""
    if _fork_from_here:
        return multiprocessing.get_context("fork")
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # no effect once the server has started
    return context


_fork_from_here = False


def fork_simulations_from_here() -> None:
    """Fork each simulation from this process instead of from a server process: for a process
    in which nothing has run yet (`titan-train --dry-run`: the config loaded and checked, no
    process group, no tensor computed, nothing compiled), a fork starts as fresh as the
    server's, without importing torch and the trainer a second time (several seconds of CPU
    per dry run). Linux only (elsewhere forking a process that has imported torch is not
    safe); a no-op there. Call it only where nothing that leaves state in torch will run
    before the simulations (a process group, a compile, a DTensor operation)."""
    global _fork_from_here
    if sys.platform != "linux":
        return
    for name in _PRELOAD:  # once here, not in each simulation
        importlib.import_module(name)
    _fork_from_here = True


# What a simulation imports: the trainer, the memory trackers, and inductor's partitioner with
# what it uses (for compiled blocks; a second of CPU more where nothing is compiled).
_PRELOAD = [
    __name__,
    "titan_parallel.compiled_memory",
    "titan_parallel.cuda_kernels",
    "torch.distributed._tools.fsdp2_mem_tracker",
    "torch._inductor.compile_fx",
    "networkx",
]


def _simulate_rank_here(
    config: JobConfig,
    world_size: int,
    rank: int,
    vocab_size: int,
    role: str,
    kernels: str,
    phases: bool,
) -> RoleResult:
    init_logging(rank=0)
    quiet_simulation()
    progress = Progress(f"dry run: {role}", 1, out=_phase_lines.put) if phases else None
    with fake_process_group(world_size, rank):
        return measure_rank(
            config,
            world_size,
            vocab_size,
            role,
            fake=True,
            kernels=kernels,
            phase=None if progress is None else progress.mark,
        )


def quiet_simulation() -> None:
    """What a simulation says is the dry run's table and verdict: its building and stepping
    log only errors. The real run prints the rest where it matters (Float8's line per layer it
    keeps in high precision, Dynamo's advice on compiling the model, torch's notices of its
    own deprecated internals such as `is_opaque_value`), which here only broke up the table."""
    logging.getLogger("titan").setLevel(logging.WARNING)
    torch._logging.set_logs(all=logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch(\.|$)")


def measure_rank(
    config: JobConfig,
    world_size: int,
    vocab_size: int,
    role: str,
    *,
    fake: bool,
    kernels: Literal["cuda", "cpu"] = "cpu",
    after_build: Callable[[ParallelRuntime, list], None] | None = None,
    real_compile: bool = False,
    phase: Callable[[str], None] | None = None,
) -> RoleResult:
    """This rank's memory for one training step of `config`, in a process group that exists
    (fake or real): the trainer's own build, initialisation, optimizer and step, measured by
    the memory tracker. With `fake`, every tensor is fake and nothing is allocated; without,
    the same runs for real (how the estimate is validated) and the process's resident-set
    growth over the step is recorded too. With `kernels = "cuda"` (fake tensors only),
    operators whose CUDA kernels save less for backward than the CPU's run as on CUDA.
    `after_build(runtime, parts)` may change the parts before they get memory (bench/
    throughput.py's FSDP over one device, say). With `real_compile` (real tensors only) the
    config's compile backend compiles for real, a first step compiles untracked, and only the
    resident set measures inductor's buffers (the tracker does not see them all). `phase` is
    told of each part as it finishes (built, initialised, step measured)."""
    phase = phase or (lambda _: None)
    if kernels == "cuda" and not fake:
        raise ValueError("CUDA kernels are emulated on fake tensors only")
    if real_compile and fake:
        raise ValueError("real compilation needs real tensors")
    config = _simulation_config(config, real_compile=real_compile)
    dims, runtime, parts = build_rank(config, world_size, vocab_size, fake=fake)
    if after_build is not None:
        after_build(runtime, parts)
    phase("model built and parallelised")
    with fake_tensors() if fake else contextlib.nullcontext():
        runtime.materialize(parts)
        init_peak = estimate_init_memory(parts, lambda: runtime.init_weights(parts))
        optimizer = build_optimizer(
            parts, config.optimizer, total_steps=config.training.steps, dims=dims
        )
        _create_optimizer_state(parts, optimizer)
        phase("weights initialised, optimizer state made")
        tracer = StepTrace(group_labels(dims)) if fake else None
        step = _step_fn(config, runtime, parts, optimizer, vocab_size, tracer)
        if real_compile:
            step()  # compiles: the compiler's own memory is not the step's
        rss = None if fake else _RSSGrowth()
        resident = 0 if fake else resident_bytes(parts, optimizer)
        with rss or contextlib.nullcontext(), _kernels(kernels):
            breakdown = estimate_step_memory(parts, optimizer, step, warmup_steps=0)
            offloaded = offloaded_bytes() if kernels == "cuda" else 0
        phase("training step measured")
        shapes = _state_shapes(parts)
    return RoleResult(
        role,
        dist.get_rank(),
        breakdown,
        init_peak,
        shapes,
        offloaded,
        None if rss is None else resident + rss.growth,
        None if tracer is None else tracer.work(),
        runtime.flops_per_token,
        len(parts),
    )


def build_rank(
    config: JobConfig, world_size: int, vocab_size: int, *, fake: bool
) -> tuple[ParallelDims, ParallelRuntime, list]:
    """This rank's model parts as the trainer builds and parallelises them (not yet
    materialised), in a process group that exists, for `config` as the simulation runs it
    (`_simulation_config`): the world mesh, the runtime and the parts."""
    layout = Layout.resolve(config, world_size)  # the family found by name once, here
    dims = layout.dims
    dims.build_mesh("cpu")
    dtype = target_compute_dtype(config.training.mixed_precision_param)
    if (
        not fake
        and dtype == torch.bfloat16
        and config.training.dtype == "float32"  # bf16 parameters compute in bf16 everywhere
        and not supports_bf16(torch.device("cpu"))
    ):
        dtype = torch.float32  # what the trainer itself would compute in here
    seed = config.training.seed or 0
    runtime = build_parallel_runtime(
        config, dims, torch.device("cpu"), dtype, seed, cross_entropy_loss
    )
    if (
        config.model.attn_mask_type == "block_causal"
        and dims.cp_enabled
        and layout.cp_style() == "ring"
    ):
        # The ring over packed documents (its masks, its exchanges) is simulated with one
        # document per row, its most work: fake ids cannot be read, and the measured step's
        # random tokens never hold `vocab_size`, so both plan the same ring.
        runtime.document_start_id = vocab_size
    converters = build_converters(config, dims)
    stage_io = (
        _probe_stage_io(config, layout.spec, runtime, vocab_size, converters, fake)
        if dims.pp_enabled
        else None
    )
    parts = build_model(config, runtime, vocab_size, converters, stage_io, layout=layout)
    return dims, runtime, parts


def _kernels(kernels: str) -> contextlib.AbstractContextManager:
    return cuda_kernels() if kernels == "cuda" else contextlib.nullcontext()


class _RSSGrowth:
    """How far the process's resident set rose above its level at entry (Linux)."""

    def __enter__(self) -> _RSSGrowth:
        gc.collect()
        self.monitor = MemoryMonitor(torch.device("cpu"))
        self.monitor.reset_peak()
        self.start = self.monitor.stats().current_gib
        return self

    def __exit__(self, *exc) -> None:
        self.growth = int((self.monitor.stats().peak_gib - self.start) * GiB)


def _probe_stage_io(
    config, spec: ModelSpec, runtime: ParallelRuntime, vocab_size: int, converters, fake: bool
):
    """What pipeline stages pass each other, from a one-block copy of the model (and the
    blocks it runs after its output, multi-token prediction's) with the same
    parallelisms (a fake process group cannot carry the stages' run-time shape exchange)."""
    probe = build_meta_model(spec, config, vocab_size)
    for converter in converters:
        converter.convert(probe)
    for name in list(probe.layers)[1:]:
        if f"layers.{name}" not in probe.post_blocks:  # those run after the output: kept
            del probe.layers[name]
    runtime.parallelize_part(probe)
    with fake_tensors() if fake else contextlib.nullcontext():
        runtime.materialize([probe])
        runtime.init_weights([probe], parameters=False)
        p = config.parallelism
        tokens = torch.randint(
            0,
            vocab_size,
            (
                p.pipeline_parallel_microbatch_size,
                config.training.seq_len // p.context_parallel_degree,
            ),
        )
        return titan_parallel.infer_stage_io(probe, tokens)


def _create_optimizer_state(parts, optimizer) -> None:
    # The measured step should be a steady-state one, with the optimizer's moments already
    # there during forward and backward; one step on zero gradients creates them.
    params = [p for part in parts for p in part.parameters() if p.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step_fn(
    config, runtime: ParallelRuntime, parts, optimizer, vocab_size, tracer: StepTrace | None = None
) -> Callable[[], None]:
    t = config.training
    accum = BatchShape.of(t, runtime.dims.dp_degree).accumulation
    # Gradients are allocated by the first microbatch and kept: the second one shows the
    # steady state of accumulation; more would repeat it.
    microbatches = min(accum, 2)
    inputs = torch.randint(0, vocab_size, (t.local_batch_size, t.seq_len))
    labels = torch.randint(0, vocab_size, (t.local_batch_size, t.seq_len))
    trace = tracer.phase if tracer is not None else lambda *_, **__: contextlib.nullcontext()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for _ in range(microbatches):
            # The last microbatch's work stands for each of the step's `accum`.
            with trace("microbatch", repeat=accum):
                runtime.forward_backward(parts, inputs, labels, scale=1.0 / accum)
        with trace("optimizer", repeat=1):
            runtime.clip_grad_norm(parts, t.max_norm)
            optimizer.step()

    return step


def _state_shapes(parts) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for part in parts:
        for name, value in part.state_dict().items():
            if isinstance(value, torch.Tensor):
                shapes[canonical_name(name)] = tuple(value.shape)
    return shapes


# ----------------------------------------------------------------------------- the whole job


def simulate(config: JobConfig, world_size: int, vocab_size: int, *, progress=None) -> Simulation:
    """Every rank role of the job, each simulated in a process of its own. With `progress`
    (a `titan_core.Progress`), each role's start, the parts of it as they finish, and each
    role's end with an estimate of the time left are said (a 405B role takes minutes)."""
    start = time.perf_counter()
    roles = []
    for role, rank in rank_roles(config, world_size):
        if progress is not None:
            progress.say(f"simulating {role} (rank {rank} of {world_size}) on fake tensors")
        result = simulate_rank(
            config, world_size, rank, vocab_size, role, phases=progress is not None
        )
        roles.append(result)
        if progress is not None:
            progress.done(f"{role} simulated: step peak {result.peak / GiB:.2f} GiB")
    return Simulation(config, world_size, vocab_size, roles, time.perf_counter() - start)
