"""titan-parallel: apply FSDP2/HSDP/DDP, tensor parallel (with sequence and loss parallel),
expert parallel for mixture-of-experts layers, pipeline and context parallel, activation checkpointing and torch.compile to a block-structured
model; the distributed utilities a training loop needs with them (global gradient clipping,
metric reduction, exact initialisation under sharding); optimizers exact
under sharding (Ranger21, AdamW with bfloat16 states, Muon); per-rank memory estimates of any
layout at full size on fake process groups and fake tensors; and fault-tolerant replica groups
with TorchFT (the `ft` extra)."""

import importlib.metadata
from typing import TYPE_CHECKING

from titan_core.lazy import attach

# The public API, each name imported from its module on first use (titan_core.lazy): a
# light module of the package loads without the others, and torch with them.
if TYPE_CHECKING:
    from titan_parallel.activation_checkpoint import SAVE_OPS, apply_ac
    from titan_parallel.alltoall_attention import (
        alltoall_heads_problems,
        apply_alltoall_cp,
        head_attention_layers,
    )
    from titan_parallel.chunked_loss import DeferredLinear, chunked_cross_entropy, defer_output
    from titan_parallel.compile import apply_compile, compile_loss
    from titan_parallel.compiled_memory import simulated_backend
    from titan_parallel.config import (
        ActivationCheckpoint,
        Compile,
        FaultToleranceConfig,
        MuonOptions,
        Parallelism,
        Ranger21Options,
        check_parallelize_config,
    )
    from titan_parallel.context_parallel import (
        SUPPORTED_TORCH,
        check_cp_seq_len,
        check_cp_support,
        cp_context,
        cp_unshard,
        enable_cpu_ring_attention,
        resolve_cp_style,
    )
    from titan_parallel.cuda_kernels import cuda_kernels
    from titan_parallel.data_parallel import (
        apply_ddp,
        apply_fsdp,
        autocast_context,
        resolve_reshard_after_forward,
    )
    from titan_parallel.document_ring import (
        DocumentRing,
        apply_document_ring_cp,
        head_tail_imbalance,
        plan_document_ring,
    )
    from titan_parallel.expert_parallel import apply_ep, expert_parallel_problems, moe_layers
    from titan_parallel.fault_tolerance import ReplicaGroup, SemiSync, start_lighthouse
    from titan_parallel.grad_clip import (
        clip_grad_norm_,
        dist_max,
        dist_mean,
        dist_sum,
        total_grad_norm,
    )
    from titan_parallel.init import init_weights_exact
    from titan_parallel.memory_estimate import (
        MemoryBreakdown,
        StepMemoryTracker,
        estimate_init_memory,
        estimate_step_memory,
        fake_process_group,
        fake_tensors,
        resident_bytes,
    )
    from titan_parallel.muon import Muon, build_muon, muon_param_groups, newton_schulz, uses_muon
    from titan_parallel.parallelize import parallelize
    from titan_parallel.pipeline import (
        SCHEDULES,
        Pipeline,
        PipelinePlan,
        StageIO,
        broadcast_pipeline_loss,
        build_pipeline,
        infer_stage_io,
        plan_pipeline,
        pp_total_norm,
        schedule_name,
    )
    from titan_parallel.pipeline_split import (
        build_stage_modules,
        check_ties_within_stages,
        split_balanced,
        split_by_layers,
        validate_split_points,
    )
    from titan_parallel.qk_clip import QKClip, max_logits
    from titan_parallel.ranger21 import AdamW, Ranger21, build_ranger21, stochastic_round_to_bf16
    from titan_parallel.sharded_stats import reduce_sums, row_sums_groups, total_sums_groups
    from titan_parallel.tensor_parallel import (
        apply_tp,
        check_tp_plan,
        copy_block_inputs,
        loss_context,
    )
    from titan_parallel.tied import keep_ties_on_conversion, tied_parameter_groups

__getattr__, __dir__ = attach(__name__, __file__)

__version__ = importlib.metadata.version(
    "titan-llm-parallel"
)  # the pyproject's version, one source

__all__ = [
    "DeferredLinear",
    "chunked_cross_entropy",
    "defer_output",
    "FaultToleranceConfig",
    "ReplicaGroup",
    "SemiSync",
    "start_lighthouse",
    "SAVE_OPS",
    "AdamW",
    "Muon",
    "QKClip",
    "max_logits",
    "MuonOptions",
    "build_muon",
    "muon_param_groups",
    "newton_schulz",
    "uses_muon",
    "Ranger21",
    "Ranger21Options",
    "build_ranger21",
    "reduce_sums",
    "row_sums_groups",
    "stochastic_round_to_bf16",
    "total_sums_groups",
    "ActivationCheckpoint",
    "MemoryBreakdown",
    "StepMemoryTracker",
    "estimate_init_memory",
    "estimate_step_memory",
    "fake_process_group",
    "fake_tensors",
    "resident_bytes",
    "simulated_backend",
    "Compile",
    "Parallelism",
    "apply_ac",
    "apply_compile",
    "apply_ddp",
    "apply_ep",
    "expert_parallel_problems",
    "moe_layers",
    "apply_fsdp",
    "apply_tp",
    "autocast_context",
    "check_parallelize_config",
    "check_tp_plan",
    "clip_grad_norm_",
    "compile_loss",
    "cuda_kernels",
    "copy_block_inputs",
    "dist_max",
    "dist_mean",
    "dist_sum",
    "init_weights_exact",
    "keep_ties_on_conversion",
    "loss_context",
    "parallelize",
    "resolve_reshard_after_forward",
    "tied_parameter_groups",
    "total_grad_norm",
    "SCHEDULES",
    "SUPPORTED_TORCH",
    "Pipeline",
    "PipelinePlan",
    "StageIO",
    "infer_stage_io",
    "plan_pipeline",
    "schedule_name",
    "broadcast_pipeline_loss",
    "build_pipeline",
    "build_stage_modules",
    "check_cp_seq_len",
    "check_cp_support",
    "check_ties_within_stages",
    "cp_context",
    "cp_unshard",
    "enable_cpu_ring_attention",
    "alltoall_heads_problems",
    "apply_alltoall_cp",
    "head_attention_layers",
    "DocumentRing",
    "apply_document_ring_cp",
    "head_tail_imbalance",
    "plan_document_ring",
    "resolve_cp_style",
    "pp_total_norm",
    "split_balanced",
    "split_by_layers",
    "validate_split_points",
]
