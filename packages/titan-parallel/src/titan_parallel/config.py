"""The config sections titan-parallel owns: [parallelism], [activation_checkpoint], [compile],
[optimizer.ranger21] and [optimizer.muon] (the switches of `titan_parallel.Ranger21` and
`Muon`), and [fault_tolerance] (`titan_parallel.fault_tolerance`'s replica groups). They load
without torch: a trainer reads and checks its command line before torch's seconds of import.

Names and defaults follow torchtitan, so a torchtitan TOML loads unchanged. Each `validate()`
checks its own section; `check_parallelize_config` checks combinations across sections and
the machine (the trainer's root `validate()` calls it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # imported where used: the sections load, for --help and the config
    from titan_core.parallel_dims import ParallelDims  # checks, before torch is imported

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
    context_parallel_style: Literal["auto", "ring", "alltoall"] = "auto"
    """How attention sees the whole sequence under context parallel: "ring" passes keys and
    values round the ranks (torch's ring attention, causal only, load-balanced); "alltoall"
    trades sequence pieces for whole heads around attention (each rank attends over every
    position with 1/cp of the heads: any mask, including block_causal, and any kernel; query
    heads per TP rank must divide by the degree); "auto" takes alltoall where the heads
    divide and ring elsewhere."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How the ring style exchanges keys and values between ranks (gather them all once, or
    pass them on step by step)."""
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
    """Number of ranks the experts of mixture-of-experts layers are split over (each holds
    num_experts / degree whole experts; tokens travel to them by all-to-all). Borrowed from
    data_parallel_shard x context_parallel, which it must divide; FSDP shards the expert
    weights over the ranks it leaves."""
    expert_tensor_parallel_degree: int = -1
    """Ranks each expert's hidden features are split over (mixture-of-experts models): Titan
    splits experts over the tensor-parallel ranks, so -1 (the default) or
    tensor_parallel_degree; 1 with TP on (torchtitan's whole experts under TP, tokens split
    over the TP ranks) is not implemented."""

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
        if self.context_parallel_degree > 1 and self.context_parallel_style != "alltoall":
            from titan_parallel.context_parallel import check_cp_support

            problems += check_cp_support()
        return problems

    def expert_tp_problems(self, tp: int | None = None) -> list[str]:
        """For a model with experts: `expert_tensor_parallel_degree` must follow the
        tensor-parallel degree (a dense model ignores it, as torchtitan does). `tp`: the degree
        in force (a `ParallelDims`' tp), default this section's."""
        etp = self.expert_tensor_parallel_degree
        tp = self.tensor_parallel_degree if tp is None else tp
        if etp in (-1, tp):
            return []
        return [
            f"[parallelism] expert_tensor_parallel_degree = {etp} with tensor_parallel_degree = {tp}:"
            " Titan splits every expert's hidden features over the tensor-parallel ranks\n"
            f"set expert_tensor_parallel_degree = {tp} (or -1, the default, which follows"
            " tensor_parallel_degree)"
        ]

    @property
    def loss_parallel_enabled(self) -> bool:
        """Whether the loss runs on vocabulary-sharded logits (TP on and not disabled)."""
        return self.tensor_parallel_degree > 1 and not self.disable_loss_parallel

    def pipeline_options(self) -> dict:
        """The pipeline keys as the keyword arguments `plan_pipeline` and `build_pipeline`
        share (schedule, microbatch size, the split), so that a caller passes them whole."""
        return {
            "schedule": self.pipeline_parallel_schedule,
            "microbatch_size": self.pipeline_parallel_microbatch_size,
            "layers_per_stage": self.pipeline_parallel_layers_per_stage,
            "first_stage_less_layers": self.pipeline_parallel_first_stage_less_layers,
            "last_stage_less_layers": self.pipeline_parallel_last_stage_less_layers,
            "split_points": self.module_fqns_per_model_part,
            "csv_path": self.pipeline_parallel_schedule_csv or None,
        }

    def job_world_size(self) -> int | None:
        """The processes these degrees describe, or None while data_parallel_shard_degree is
        -1 (it takes what the job's world size leaves)."""
        if self.data_parallel_shard_degree == -1:
            return None
        return (
            self.data_parallel_replicate_degree
            * self.data_parallel_shard_degree
            * self.context_parallel_degree
            * self.tensor_parallel_degree
            * self.pipeline_parallel_degree
        )

    def build_parallel_dims(self, world_size: int) -> ParallelDims:
        """The `ParallelDims` these degrees describe for a job of `world_size` processes
        (raises `ConfigError` when they do not fit)."""
        from titan_core.parallel_dims import ParallelDims  # noqa: PLC0415 - imports torch

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
    mode: Literal["none", "full", "selective", "memory_budget"] = "selective"
    """Recompute activations in backward instead of keeping them: none, every block (full),
    selected blocks/ops (selective, see selective_ac_option), or what the compiler's partitioner
    chooses to keep within `memory_budget` (memory_budget; needs [compile] of the model)."""
    selective_ac_option: str = "op"
    """For selective mode: `op` keeps the outputs of expensive ops (matmuls, attention, reductions)
    and recomputes the rest; an integer k checkpoints every k-th block fully."""
    preserve_rng_state: bool = False
    """Replay the random state during recomputation, so dropout-like ops match (costs time)."""
    memory_budget: float = 0.5
    """For memory_budget mode: the share, from 0 to 1, of a compiled block's activations (as
    the compiler would keep them without a budget) that may stay for backward; the
    partitioner recomputes the cheapest rest (by FLOPs). 1: the compiler's default, 0: about
    what full recomputation keeps. torch.compile's `activation_memory_budget`."""
    cpu_offload: bool = False
    """Move the tensors each block saves for backward to host memory during forward and back
    during its backward (pinned memory, asynchronous copies on CUDA): a step's activations
    leave the device, at the cost of copying them there and back (host-link bandwidth). Works
    with every mode; parameters and tensor-parallel (DTensor) activations stay on the device.
    On a CPU the same copies run and save nothing."""

    def validate(self) -> list[str]:
        option = self.selective_ac_option
        problems = []
        if (
            self.mode == "selective"
            and option != "op"
            and not (option.isdigit() and int(option) >= 1)
        ):
            problems.append(
                f'[activation_checkpoint] selective_ac_option = "{option}" is not valid\n'
                'use "op" to save expensive ops, or a positive integer k to checkpoint every k-th block'
            )
        if not 0 <= self.memory_budget <= 1:
            problems.append(
                f"[activation_checkpoint] memory_budget = {self.memory_budget} is not valid\n"
                "use a share from 0 (recompute what can be) to 1 (the compiler's default)"
            )
        if self.cpu_offload and (
            self.mode == "full" or (self.mode == "selective" and option == "op")
        ):
            problems.append(
                f"[activation_checkpoint] cpu_offload = true with mode = {self.mode}"
                + (' (selective_ac_option = "op")' if self.mode == "selective" else "")
                + ": every block is checkpointed and keeps its own tensors, so there is"
                " nothing to offload\n"
                'use mode = "none", "memory_budget" or selective with an integer option,'
                " or turn cpu_offload off"
            )
        if self.mode == "memory_budget" and not has_memory_budget():
            import torch  # noqa: PLC0415 - only this setting asks about torch

            problems.append(
                f'[activation_checkpoint] mode = "memory_budget" needs torch.compile\'s activation'
                f" memory budget, which torch {torch.__version__} does not have\n"
                'upgrade torch, or use mode = "selective" or "full"'
            )
        return problems


def has_memory_budget() -> bool:
    """Whether this torch's compiler partitioner takes an activation memory budget."""
    from torch._functorch import config

    return hasattr(config, "activation_memory_budget")


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
    if ac.mode == "memory_budget" and not compiled:
        problems.append(
            '[activation_checkpoint] mode = "memory_budget" is applied by the compiler\'s'
            " partitioner, and the model is not compiled\n"
            'set [compile] enable = true with "model" in components, or use mode = "selective"'
        )
    elif ac.mode == "memory_budget" and compile.backend == "eager":
        problems.append(
            '[activation_checkpoint] mode = "memory_budget" needs a compile backend that'
            " partitions forward and backward, and backend = eager does not\n"
            "use --compile.backend inductor (or aot_eager)"
        )
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


@dataclass
class Ranger21Options:
    """[optimizer.ranger21]: Ranger21's components (Wright & Demeure 2021, arXiv:2106.13731),
    each switchable. lr, beta1, beta2, eps and weight_decay come from [optimizer]; the
    defaults below are the reference implementation's."""

    core: Literal["adamw", "madgrad"] = "adamw"
    """The core optimizer: AdamW, or MADGRAD (Defazio & Jelassi 2021; beta1 is its momentum)."""
    agc: bool = True
    """Adaptive gradient clipping, unit-wise (Brock et al. 2021, arXiv:2102.06171)."""
    agc_clip: float = 1e-2
    """AGC clips a unit's gradient norm to this times its parameter norm."""
    agc_eps: float = 1e-3
    """AGC's floor on a unit's parameter norm (so that zero-initialised units can move)."""
    gradient_centralization: bool = True
    """Subtract each row's mean from a matrix's gradient (Yong et al. 2020, arXiv:2004.01461)."""
    pnm: bool = True
    """Positive-negative momentum (Xie et al. 2021, arXiv:2103.17182); AdamW core only."""
    pnm_beta0: float = 1.0
    """Positive-negative momentum's weight of the other momentum buffer."""
    norm_loss: bool = True
    """Norm loss (Georgiou et al. 2021, arXiv:2103.06583): pulls each unit's norm towards 1."""
    norm_loss_factor: float = 1e-4
    """Norm loss's coefficient."""
    stable_weight_decay: bool = True
    """Stable weight decay (Xie et al. 2020, arXiv:2011.11152): the decay is divided by the
    root of the model's mean second moment; false: AdamW's decoupled decay."""
    weight_decay: float = 1e-4
    """Ranger21's decay coefficient, used instead of [optimizer] weight_decay (AdamW's 0.1
    divided by a mean gradient scale of ~1e-3 would take a tenth of each weight per step)."""
    warmup: bool = True
    """Ranger21's linear warm-up (Ma & Yarats 2019, arXiv:1910.04209). With warmup or warmdown
    on, Ranger21 schedules the learning rate itself and [lr_scheduler] is not applied."""
    warmup_steps: int = -1
    """Warm-up length; -1: 2 / (1 - beta2) steps, or 22% of the run when that is over 45%."""
    warmdown: bool = True
    """The explore-exploit schedule's warm-down: flat, then linear to `warmdown_min_lr`."""
    warmdown_start_pct: float = 0.72
    """Share of training.steps after which the warm-down starts."""
    warmdown_min_lr: float = 3e-5
    """Learning rate at the last step."""
    lookahead: bool = True
    """Lookahead (Zhang et al. 2019, arXiv:1907.08610): keeps slow weights (memory: one more
    copy of the parameters) and pulls the weights towards them every `lookahead_steps`."""
    lookahead_steps: int = 5
    """Steps between Lookahead merges."""
    lookahead_alpha: float = 0.5
    """Weight of the fast weights in a Lookahead merge."""
    softplus: bool = True
    """Pass the adaptive denominator through softplus (Tong et al. 2019, arXiv:1908.00700)."""
    softplus_beta: float = 50.0
    """Softplus sharpness: denominators below about 1 / beta are raised towards log(2) / beta."""
    compiled_step: bool = False
    """Take the step as three torch.compile'd kernels per parameter instead of foreach passes:
    the same formulas with fewer passes over memory (see bench/optim.py), after a one-time
    compile of tens of seconds per process on a CPU (cached by inductor across runs)."""

    def validate(self) -> list[str]:
        problems = []
        checks = (
            ("agc_clip", self.agc_clip > 0, "use a positive ratio"),
            ("agc_eps", self.agc_eps >= 0, "use 0 or more"),
            ("norm_loss_factor", self.norm_loss_factor >= 0, "use 0 or more"),
            ("weight_decay", self.weight_decay >= 0, "use 0 or more"),
            ("warmup_steps", self.warmup_steps >= -1, "use -1 (automatic) or 0 or more"),
            ("warmdown_start_pct", 0 <= self.warmdown_start_pct <= 1, "use a value in [0, 1]"),
            ("warmdown_min_lr", self.warmdown_min_lr >= 0, "use 0 or more"),
            ("lookahead_steps", self.lookahead_steps >= 1, "use 1 or more"),
            ("lookahead_alpha", 0 <= self.lookahead_alpha <= 1, "use a value in [0, 1]"),
            ("softplus_beta", self.softplus_beta > 0, "use a positive number"),
        )
        for key, ok, fix in checks:
            if not ok:
                problems.append(
                    f"[optimizer.ranger21] {key} = {getattr(self, key)} is not valid\n{fix}"
                )
        return problems


@dataclass
class MuonOptions:
    """[optimizer.muon]: Muon (Jordan et al. 2024) for the hidden matrices, AdamW ([optimizer]
    lr, beta1, beta2, eps, weight_decay) for embeddings, norms, biases, the output head and MoE
    routers, or whatever [[optimizer.param_groups]] gives `muon = false`."""

    momentum: float = 0.95
    """Muon's momentum (an exponential average of the gradients)."""
    nesterov: bool = True
    """Nesterov momentum: orthogonalise (1 - momentum) g + momentum m instead of m."""
    ns_steps: int = 5
    """Newton-Schulz iterations (quintic, Jordan's coefficients)."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of the Newton-Schulz iterations: bfloat16 as in the reference (fast on GPUs),
    float32 for steps that equal across layouts to fp32 rounding; `auto`, bfloat16 where the
    parameters' device computes it natively (a GPU, a CPU with AVX-512 BF16 or AMX), float32
    elsewhere (on an AVX2-only CPU bf16 matmuls are emulated, about 25x slower than fp32)."""
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per-matrix scale of the learning rate: `match_rms_adamw`, 0.2 sqrt(max(rows, cols))
    (Moonlight: updates with AdamW's RMS, so [optimizer] lr and weight_decay carry over), or
    `original`, sqrt(max(1, rows / cols)) (Jordan's; set `lr` to about 0.02)."""
    lr: float | None = None
    """Learning rate of the matrices Muon orthogonalises (a param group's own lr wins); none:
    [optimizer] lr. [lr_scheduler] scales it like every group's."""
    distributed: Literal["gather", "owner"] = "gather"
    """How a sharded matrix is orthogonalised: `gather`, every rank of its sharding group
    gathers it and runs Newton-Schulz (one full matrix at a time per rank); `owner`, the
    matrices are dealt round-robin to those ranks, each orthogonalises its own and sends the
    shards back (communication and compute divided by the group size; FSDP, HSDP or TP alone,
    the rest gathered)."""
    qk_clip_tau: float = 0.0
    """MuonClip (Kimi K2): after each step, the query and key projections of every attention
    head whose largest logit (q . k x softmax scale) in the step exceeded this are scaled so
    that it would have been this (the paper's 100; titan_parallel.QKClip). The metric line
    then shows the step's largest logit (`maxlogit`). 0: off. Not with context parallel."""

    def validate(self) -> list[str]:
        problems = []
        checks = (
            ("momentum", 0 <= self.momentum < 1, "use a value in [0, 1)"),
            ("qk_clip_tau", self.qk_clip_tau >= 0, "use a positive logit bound, or 0 (off)"),
            ("ns_steps", self.ns_steps >= 1, "use 1 or more"),
            ("lr", self.lr is None or self.lr > 0, "use a positive learning rate, or none"),
        )
        for key, ok, fix in checks:
            if not ok:
                problems.append(
                    f"[optimizer.muon] {key} = {getattr(self, key)} is not valid\n{fix}"
                )
        return problems


@dataclass
class FaultToleranceConfig:
    """[fault_tolerance]: torchtitan's keys for TorchFT replica groups."""

    enable: bool = False
    """Average gradients across replica groups through TorchFT, so that a group can die and
    rejoin while the others keep training. Needs the `ft` extra and a running lighthouse."""
    replica_id: int = 0
    """This replica group's index, 0 .. group_size - 1 (the same on every rank of the group)."""
    group_size: int = 1
    """Number of replica groups the job is planned for (the data is sharded over them)."""
    min_replica_size: int = 1
    """Fewest replica groups a step needs to commit. With group_size, no step is taken with a
    group missing: the others wait for it to come back."""
    process_group_timeout_ms: int = 10000
    """How long a cross-group collective or commit vote may take before the step fails."""
    quorum_timeout_ms: int = 60000
    """How long a group waits for a quorum (other groups starting or coming back)."""
    lighthouse: str = ""
    """The lighthouse's address (http://host:port); empty reads TORCHFT_LIGHTHOUSE."""
    semi_sync_method: str = ""
    """Empty: average gradients every step. `local_sgd`: each group steps alone and the groups
    average their weights every sync_steps steps (Stich 2019). `diloco`: every sync_steps
    steps the averaged change of the weights is applied by an outer Nesterov SGD (Douillard et
    al. 2023)."""
    sync_steps: int = 5
    """Steps between two synchronisations with local_sgd or diloco."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""

    def validate(self) -> list[str]:
        """The problems of this section, each naming the key and the fix (empty: none)."""
        problems = []
        if self.group_size < 1:
            problems.append(
                f"[fault_tolerance] group_size = {self.group_size} is not valid\n"
                "there must be at least one replica group"
            )
        elif not 0 <= self.replica_id < self.group_size:
            problems.append(
                f"[fault_tolerance] replica_id = {self.replica_id} is outside 0 .. "
                f"{self.group_size - 1} (group_size = {self.group_size})\n"
                "give each replica group its own index"
            )
        if self.group_size >= 1 and not 1 <= self.min_replica_size <= self.group_size:
            problems.append(
                f"[fault_tolerance] min_replica_size = {self.min_replica_size} is not valid\n"
                f"use 1 .. group_size ({self.group_size})"
            )
        if self.semi_sync_method not in SEMI_SYNC_METHODS:
            problems.append(
                f"[fault_tolerance] semi_sync_method = {self.semi_sync_method!r} is not known\n"
                "use local_sgd, diloco, or leave it empty to average gradients every step"
            )
        if self.sync_steps < 1:
            problems.append(f"[fault_tolerance] sync_steps = {self.sync_steps}: use 1 or more")
        for key in ("process_group_timeout_ms", "quorum_timeout_ms"):
            if getattr(self, key) <= 0:
                problems.append(
                    f"[fault_tolerance] {key} = {getattr(self, key)}: use a positive time"
                )
        return problems


SEMI_SYNC_METHODS = ("", "local_sgd", "diloco")
