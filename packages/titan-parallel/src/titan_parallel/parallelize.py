"""`parallelize`: the one call that applies every parallelism to a model built on the meta device.

Order matters and is fixed: tensor parallel first (it changes parameters into DTensors on the
TP mesh), then expert parallel (mixture-of-experts layers: experts over the EP and TP meshes),
then all-to-all context parallel (wraps the attention layers, which see their TP heads), then
activation checkpointing (wraps blocks), then compile (compiles the wrapped blocks), then
FSDP/HSDP or DDP (shards what TP and EP left, and keeps its hooks outside compiled code).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_core.config import ConfigError
from titan_core.parallel_dims import ParallelDims
from titan_core.protocols import TPPlan
from titan_parallel.activation_checkpoint import apply_ac
from titan_parallel.alltoall_attention import alltoall_heads_problems, apply_alltoall_cp
from titan_parallel.compile import apply_compile
from titan_parallel.config import (
    ActivationCheckpoint,
    Compile,
    Parallelism,
    check_parallelize_config,
)
from titan_parallel.context_parallel import resolve_cp_style
from titan_parallel.data_parallel import apply_ddp, apply_fsdp
from titan_parallel.document_ring import apply_document_ring_cp
from titan_parallel.expert_parallel import apply_ep, moe_layers, tp_plan_overlaps
from titan_parallel.tensor_parallel import apply_tp, copy_block_inputs
from titan_parallel.tied import keep_ties_on_conversion


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    plan: TPPlan | None = None,
    *,
    parallelism: Parallelism | None = None,
    ac: ActivationCheckpoint | None = None,
    compile: Compile | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
    cp_style: str | None = None,
) -> nn.Module:
    """Apply TP -> EP -> all-to-all CP -> activation checkpointing -> compile -> FSDP/HSDP/DDP to `model`, in
    place (EP, with the TP of mixture-of-experts layers, whenever the model has such layers).

    `model` follows `titan_core.protocols.ParallelizableModel` (blocks in `model.layers`) and
    is usually on the meta device; afterwards call `model.to_empty(device=...)` and initialise
    it (`init_weights_exact`, or `model.init_weights()`). `dims` must have its mesh built
    (`dims.build_mesh(device_type)`). `plan` defaults to `model.tp_plan()` when TP is on.
    `parallelism` supplies only the switches (sequence/loss/async TP, FSDP resharding, the
    expert TP setting); its degrees are never read: every degree comes from `dims`. Invalid combinations raise `ConfigError` before anything changes.
    A parameter several modules hold (tied embeddings) stays one parameter: under FSDP its
    modules share one FSDP group, under TP the plan must split it alike in each of them, and
    `model.to_empty()` / `.to()` keep it tied (plain PyTorch unties it there).
    Under context parallel, `cp_style` (default: `parallelism.context_parallel_style`, "auto"
    resolved by `resolve_cp_style` on this model) "alltoall" wraps the attention layers
    (`apply_alltoall_cp`), "ring" wraps them for packed documents (`apply_document_ring_cp`:
    used only when `cp_context` gets `document_ids`); run the model inside `cp_context(..., style=)` of the same style.
    Returns `model`.
    """
    parallelism = parallelism or Parallelism()
    ac = ac or ActivationCheckpoint(mode="none")
    compile = compile or Compile()
    device_type = dims.world_mesh.device_type
    problems = check_parallelize_config(
        parallelism, ac, compile, device_type=device_type, cpu_offload=cpu_offload, dims=dims
    )
    if dims.tp_enabled and moe_layers(model):
        problems += parallelism.expert_tp_problems(dims.tp)
        problems += tp_plan_overlaps(model, plan if plan is not None else model.tp_plan())
    style = None
    if dims.cp_enabled:
        style = resolve_cp_style(
            cp_style or parallelism.context_parallel_style, model, dims.tp, dims.cp
        )
        if style == "alltoall":
            problems += alltoall_heads_problems(model, dims.tp, dims.cp)
    if problems:
        raise ConfigError(problems)

    if dims.tp_enabled:
        plan = plan if plan is not None else model.tp_plan()
        apply_tp(
            model,
            dims.mesh("tp"),
            plan,
            sequence_parallel=parallelism.enable_sequence_parallel,
            loss_parallel=not parallelism.disable_loss_parallel,
            async_tp=parallelism.enable_async_tensor_parallel,
        )
    apply_ep(
        model, dims, sequence_parallel=dims.tp_enabled and parallelism.enable_sequence_parallel
    )
    if style == "alltoall":
        apply_alltoall_cp(model, dims.mesh("cp"))
    elif style == "ring":  # the ring over packed documents, when cp_context gets document ids
        apply_document_ring_cp(model, dims.mesh("cp"))
    apply_ac(model, ac)
    if dims.tp_enabled:
        copy_block_inputs(model)
    apply_compile(model, compile)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=parallelism.fsdp_reshard_after_forward,
            pp_enabled=dims.pp_enabled,
            cpu_offload=cpu_offload,
        )
    elif dims.dp_replicate_enabled:
        apply_ddp(model, dims.mesh("dp_replicate"), compile_enabled=compile.compiles("model"))
    # Tied parameters (an embedding shared with the output projection) stay one parameter
    # through the caller's `to_empty` too (recorded last: names as the wrappers left them).
    keep_ties_on_conversion(model)
    return model
