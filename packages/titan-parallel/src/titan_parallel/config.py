"""The config sections titan-parallel owns: [parallelism], [activation_checkpoint], [compile].

Names and defaults follow torchtitan, so a torchtitan TOML loads unchanged. Each `validate()`
checks its own section; `check_parallelize_config` checks combinations across sections and
the machine (the trainer's root `validate()` calls it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Literal

from titan_core.parallel_dims import ParallelDims

_DEGREES = (
    "data_parallel_replicate_degree",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "pipeline_parallel_degree",
    "expert_parallel_degree",
)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Number of model replicas (DDP, or the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = -1
    """Number of ranks FSDP shards parameters over; -1 uses every process the other degrees leave."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward (`always`) or keep them until backward (`never`,
    more memory, less communication). `default` reshards except under pipeline parallel."""
    tensor_parallel_degree: int = 1
    """Number of ranks each linear layer is split over (tensor parallel)."""
    disable_loss_parallel: bool = False
    """Gather the vocabulary-sharded logits before the loss instead of computing the loss on shards."""
    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with matmuls (CUDA only; needs [compile] of the model)."""
    enable_sequence_parallel: bool = True
    """Under TP, shard norms and residuals along the sequence (saves activation memory)."""
    context_parallel_degree: int = 1
    """Number of ranks the sequence is split over for attention (context parallel)."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context parallel exchanges keys and values between ranks."""
    pipeline_parallel_degree: int = 1
    """Number of pipeline stages."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule name (1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, ...)."""
    pipeline_parallel_schedule_csv: str = ""
    """A CSV file describing a custom pipeline schedule; overrides pipeline_parallel_schedule."""
    pipeline_parallel_microbatch_size: int = 1
    """Samples per pipeline microbatch; the local batch must divide by it."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Blocks per (virtual) stage; unset splits the blocks evenly over the schedule's stages."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """The first stage gets this many fewer blocks (the embedding counts as that much work)."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """The last stage gets this many fewer blocks (the output projection counts as that much work)."""
    module_fqns_per_model_part: list[list[str]] | None = None
    """Explicit module names per pipeline stage, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]."""
    expert_parallel_degree: int = 1
    """Number of ranks experts are split over (mixture-of-experts models only)."""

    def validate(self) -> list[str]:
        problems = []
        for key in _DEGREES:
            if getattr(self, key) < 1:
                problems.append(
                    f"[parallelism] {key} = {getattr(self, key)} is not valid\nuse a degree of 1 or more"
                )
        shard = self.data_parallel_shard_degree
        if shard == 0 or shard < -1:
            problems.append(
                f"[parallelism] data_parallel_shard_degree = {shard} is not valid\n"
                "use a degree of 1 or more, or -1 to use every process the other degrees leave"
            )
        if self.enable_async_tensor_parallel and self.tensor_parallel_degree == 1:
            problems.append(
                "[parallelism] enable_async_tensor_parallel = true needs tensor_parallel_degree > 1\n"
                "set tensor_parallel_degree, or turn async tensor parallel off"
            )
        if self.pipeline_parallel_microbatch_size < 1:
            problems.append(
                f"[parallelism] pipeline_parallel_microbatch_size = {self.pipeline_parallel_microbatch_size}"
                " is not valid\nuse 1 or more samples per microbatch"
            )
        if (
            self.pipeline_parallel_layers_per_stage is not None
            and self.pipeline_parallel_layers_per_stage < 1
        ):
            problems.append(
                f"[parallelism] pipeline_parallel_layers_per_stage = {self.pipeline_parallel_layers_per_stage}"
                " is not valid\nuse 1 or more, or leave it unset"
            )
        if self.context_parallel_degree > 1:
            from titan_parallel.context_parallel import check_cp_support

            problems += check_cp_support()
        return problems

    @property
    def loss_parallel_enabled(self) -> bool:
        """Whether the loss runs on vocabulary-sharded logits (TP on and not disabled)."""
        return self.tensor_parallel_degree > 1 and not self.disable_loss_parallel

    def build_parallel_dims(self, world_size: int) -> ParallelDims:
        """The `ParallelDims` these degrees describe for a job of `world_size` processes
        (raises `ConfigError` when they do not fit)."""
        return ParallelDims(
            world_size=world_size,
            dp_replicate=self.data_parallel_replicate_degree,
            dp_shard=self.data_parallel_shard_degree,
            cp=self.context_parallel_degree,
            tp=self.tensor_parallel_degree,
            pp=self.pipeline_parallel_degree,
            ep=self.expert_parallel_degree,
        )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "selective"
    """Recompute activations in backward instead of keeping them: none, every block (full), or
    selected blocks/ops (selective, see selective_ac_option)."""
    selective_ac_option: str = "op"
    """For selective mode: `op` keeps the outputs of expensive ops (matmuls, attention, reductions)
    and recomputes the rest; an integer k checkpoints every k-th block fully."""
    preserve_rng_state: bool = False
    """Replay the random state during recomputation, so dropout-like ops match (costs time)."""

    def validate(self) -> list[str]:
        option = self.selective_ac_option
        if (
            self.mode == "selective"
            and option != "op"
            and not (option.isdigit() and int(option) >= 1)
        ):
            return [
                f'[activation_checkpoint] selective_ac_option = "{option}" is not valid\n'
                'use "op" to save expensive ops, or a positive integer k to checkpoint every k-th block'
            ]
        return []


_COMPONENTS = ("model", "loss")


@dataclass
class Compile:
    enable: bool = False
    """Compile with torch.compile (each block separately, and the loss)."""
    components: list[str] = field(default_factory=lambda: list(_COMPONENTS))
    """What to compile: `model` (each block) and/or `loss`."""
    backend: str = "inductor"
    """torch.compile backend (inductor, aot_eager, eager, ...)."""

    def validate(self) -> list[str]:
        unknown = [c for c in self.components if c not in _COMPONENTS]
        if unknown:
            return [
                f"[compile] components has unknown entries {', '.join(map(repr, unknown))}\n"
                f"choose from {', '.join(_COMPONENTS)}"
            ]
        return []

    def compiles(self, component: str) -> bool:
        """Whether compile is on for `component` ("model" or "loss")."""
        return self.enable and component in self.components


def check_parallelize_config(
    parallelism: Parallelism,
    ac: ActivationCheckpoint | None = None,
    compile: Compile | None = None,
    *,
    device_type: str = "cpu",
    cpu_offload: bool = False,
    dims: ParallelDims | None = None,
) -> list[str]:
    """Combinations of the three sections, the device and CPU offload that cannot run.

    Returns problem strings (empty when fine); `parallelize` raises a `ConfigError` with them
    before touching the model, and a trainer can call this before creating process groups.
    Degrees are read from `dims` when given, else from `parallelism`.
    """
    ac = ac or ActivationCheckpoint(mode="none")
    compile = compile or Compile()
    problems = [*parallelism.validate(), *ac.validate(), *compile.validate()]
    if dims is not None:
        tp, fsdp, ddp = (
            dims.tp_enabled,
            dims.fsdp_enabled,
            dims.dp_replicate_enabled and not dims.fsdp_enabled,
        )
    else:
        p = parallelism
        tp = p.tensor_parallel_degree > 1
        fsdp = p.data_parallel_shard_degree != 1 or p.context_parallel_degree > 1
        ddp = p.data_parallel_replicate_degree > 1 and not fsdp
    compiled = compile.compiles("model")
    if parallelism.enable_async_tensor_parallel and tp:
        if device_type != "cuda":
            problems.append(
                f"[parallelism] enable_async_tensor_parallel = true needs CUDA, but the job runs on {device_type}\n"
                "turn it off (plain tensor parallel works on every device)"
            )
        elif not compiled:
            problems.append(
                "[parallelism] enable_async_tensor_parallel = true works through the compiler\n"
                'set [compile] enable = true with "model" in components'
            )
    if ddp and tp:
        problems.append(
            "[parallelism] data_parallel_replicate_degree > 1 with data_parallel_shard_degree = 1 is DDP,"
            " which does not compose with tensor parallel\n"
            "use HSDP instead: set data_parallel_shard_degree > 1 (or -1)"
        )
    if cpu_offload and not fsdp:
        problems.append(
            "CPU offload moves FSDP's parameter shards to the CPU, but FSDP is off\n"
            "set data_parallel_shard_degree > 1 (or -1), or turn CPU offload off"
        )
    if compiled and compile.backend == "inductor" and not _has_compiler(device_type):
        problems.append(
            "[compile] backend = inductor needs a C++ compiler on CPU, and none was found\n"
            "install gcc or clang, or use --compile.backend aot_eager"
        )
    return problems


def _has_compiler(device_type: str) -> bool:
    return device_type != "cpu" or any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
