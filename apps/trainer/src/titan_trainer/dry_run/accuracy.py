"""How good is the dry run's memory estimate? Predicted versus measured, per rank, for small
layouts on real CPU process groups.

For one layout (a config and a world size) this runs the dry run's simulation of every rank
role, then the same build and step for real: `world_size` processes in a gloo group, real
tensors, the same memory tracker, plus the operating system's count (the resident set). Used by
`bench/memory_predictor.py` (the table in the trainer README) and by the tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from titan_core import init_logging, load_config
from titan_parallel.memory_estimate import GiB
from titan_trainer.config import JobConfig
from titan_trainer.dry_run.simulate import (
    RoleResult,
    fresh_processes,
    measure_rank,
    rank_roles,
    simulate_rank,
)

# Qwen3's debug mixture-of-experts model instead of Llama 3's debug model.
_MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]

# Small layouts of the debug model (fp32) whose peaks are compared.
_SHARD = "--parallelism.data_parallel_shard_degree"
_CP2 = [
    "--parallelism.context_parallel_degree",
    "2",
    _SHARD,
    "1",
    "--parallelism.context_parallel_style",
]
_DOCUMENTS = ["--model.attn_mask_type", "block_causal"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "HSDP 2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2", _SHARD, "2"]),
    "FSDP 2 x TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "PP 2 (1F1B)": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2", _SHARD, "1"]),
    "CP 2 all-to-all, packed documents": (2, [*_CP2, "alltoall", *_DOCUMENTS]),
    "CP 2 ring": (2, [*_CP2, "ring"]),
    "CP 2 ring, packed documents": (2, [*_CP2, "ring", *_DOCUMENTS]),
    "FSDP 2 + AC full": (2, ["--activation_checkpoint.mode", "full"]),
    "FSDP 2 + AC selective op": (2, ["--activation_checkpoint.mode", "selective"]),
    "FSDP 2 + Float8": (2, ["--model.converters", "quantize.linear.float8"]),
    # Compiled: the real run executes the simulation's partitioned graphs (see
    # titan_parallel.compiled_memory), so the tracker sees what the simulation counts.
    "FSDP 2 compiled": (2, ["--compile.enable"]),
    "FSDP 2 + AC selective op compiled": (
        2,
        ["--activation_checkpoint.mode", "selective", "--compile.enable"],
    ),
    # Memory-saving modes: parameters, gradients and AdamW's moments in bf16; the compiler's
    # activation budget; activation offload (on a CPU the host copies are the same memory).
    "FSDP 2 bf16 params": (
        2,
        ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"],
    ),
    "1 process + AC memory_budget 0.3 compiled": (
        1,
        [
            *("--activation_checkpoint.mode", "memory_budget"),
            *("--activation_checkpoint.memory_budget", "0.3", "--compile.enable"),
        ],
    ),
    "1 process + activation offload": (1, ["--activation_checkpoint.cpu_offload", "true"]),
    "MoE FSDP 2 + AC full compiled": (
        2,
        [*_MOE, "--activation_checkpoint.mode", "full", "--compile.enable"],
    ),
    "MoE EP 2 compiled": (
        2,
        [*_MOE, "--parallelism.expert_parallel_degree", "2", "--compile.enable"],
    ),
}


def layout_config(extra: list[str], seq_len: int, batch: int) -> JobConfig:
    return load_config(
        JobConfig,
        [
            "--model.flavor",
            "debugmodel",
            "--training.seq_len",
            str(seq_len),
            "--training.local_batch_size",
            str(batch),
            "--training.mixed_precision_param",
            "float32",
            "--activation_checkpoint.mode",
            "none",
            *extra,
        ],
    )


@dataclass
class Comparison:
    layout: str
    world_size: int
    role: str
    rank: int
    predicted: int
    """Bytes at the step's peak, from the fake-tensor simulation."""
    measured: int
    """Bytes at the step's peak, the same tracker on real tensors in a real process group."""
    measured_rss: int
    """Bytes at the step's peak by the operating system (resident set)."""
    compiled_rss: int | None = None
    """Compiled layouts, when asked: the resident set's peak of the same step compiled for real
    by the config's backend (inductor), whose buffers the tracker does not all see."""

    @property
    def error(self) -> float:
        """Relative error of the prediction against the measured peak."""
        return (self.predicted - self.measured) / self.measured

    @property
    def rss_error(self) -> float:
        return (self.predicted - self.measured_rss) / self.measured_rss

    def row(self) -> dict:
        compiled = {}
        if self.compiled_rss is not None:
            compiled = {
                "compiled_rss_gib": round(self.compiled_rss / GiB, 4),
                "compiled_rss_error_pct": round(
                    100 * (self.predicted - self.compiled_rss) / self.compiled_rss, 2
                ),
            }
        return compiled | {
            "layout": self.layout,
            "world_size": self.world_size,
            "role": self.role,
            "predicted_gib": round(self.predicted / GiB, 4),
            "measured_gib": round(self.measured / GiB, 4),
            "measured_rss_gib": round(self.measured_rss / GiB, 4),
            "error_pct": round(100 * self.error, 2),
            "rss_error_pct": round(100 * self.rss_error, 2),
        }


def compare_layout(
    name: str, config: JobConfig, world_size: int, vocab_size: int, *, real_compile: bool = False
) -> list[Comparison]:
    """Predicted and measured peaks of every rank role of `config` on `world_size` ranks; with
    `real_compile` and compile on, also the resident set of the step compiled for real."""
    roles = rank_roles(config, world_size)
    predicted = {
        rank: simulate_rank(config, world_size, rank, vocab_size, role, kernels="cpu")
        for role, rank in roles
    }
    measured = measure_real(config, world_size, vocab_size)
    compiled = None
    if real_compile and config.compile.enable:
        compiled = measure_real(config, world_size, vocab_size, real_compile=True)
    return [
        Comparison(
            name,
            world_size,
            role,
            rank,
            predicted[rank].step.total,
            measured[rank].step.total,
            measured[rank].rss_peak,
            None if compiled is None else compiled[rank].rss_peak,
        )
        for role, rank in roles
    ]


def measure_real(
    config: JobConfig, world_size: int, vocab_size: int, *, real_compile: bool = False
) -> dict[int, RoleResult]:
    """Every rank's measured step memory, from `world_size` real gloo processes (compiled
    regions compiled for real with `real_compile`, see `measure_rank`). The processes are
    forked from the simulations' server, which has imported torch and the trainer already
    (several seconds of CPU per rank saved)."""
    config.parallelism.build_parallel_dims(
        world_size
    )  # a bad layout fails here, not in the workers
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world_size, config, vocab_size, tmp, real_compile),
            nprocs=world_size,
            start_method=fresh_processes().get_start_method(),
        )
        return {
            rank: pickle.loads(Path(tmp, f"rank{rank}.pkl").read_bytes())
            for rank in range(world_size)
        }


# glibc raises its mmap threshold after large frees and then keeps freed blocks in the heap,
# so the resident set would count memory no tensor holds; a fixed threshold returns large
# blocks at once and makes the resident set a fair second measurement.
_MMAP_THRESHOLD = 65536
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def _fix_mmap_threshold() -> None:
    """The fixed threshold in this worker, however it was started (forked from a server, it
    never read a MALLOC_MMAP_THRESHOLD_ variable): glibc's mallopt, where there is one."""
    # Not glibc: nothing to fix (the resident set is only the second measurement).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def _worker(
    rank: int, world_size: int, config: JobConfig, vocab_size: int, tmp: str, real_compile: bool
) -> None:
    _fix_mmap_threshold()
    init_logging(rank=rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size
    )
    try:
        result = measure_rank(
            config, world_size, vocab_size, f"rank {rank}", fake=False, real_compile=real_compile
        )
        result.checkpoint_shapes = {}
        Path(tmp, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()
