"""Data parallel: FSDP2 (`fully_shard`), HSDP (FSDP on a 2-D replicate x shard mesh) and DDP.

FSDP wraps each block of `model.layers` on its own, so that only one block's full parameters
exist at a time, then the modules before and after the blocks, then the root (which holds
whatever is left). Modules that share a parameter (a tied embedding and output projection)
are wrapped as one group, since a parameter can belong to one FSDP group only. Gradients are
averaged over the mesh (reduce-scattered for FSDP, and also all-reduced across replicas for
HSDP).
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

ReshardAfterForward = Literal["default", "always", "never"]


def resolve_reshard_after_forward(
    mode: ReshardAfterForward | bool, *, pp_enabled: bool = False
) -> bool:
    """`default` reshards unless pipeline parallel is on: a pipeline stage runs several
    microbatches forward before their backwards, and regathering per microbatch costs more
    than it saves."""
    if isinstance(mode, bool):
        return mode
    if mode not in ("default", "always", "never"):
        raise ValueError(
            f"fsdp_reshard_after_forward = {mode!r} is not valid; use default, always or never"
        )
    return {"always": True, "never": False}.get(mode, not pp_enabled)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: ReshardAfterForward | bool = "default",
    pp_enabled: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Shard `model` over `mesh` with FSDP2, in place (a 2-D mesh gives HSDP).

    Parameters are kept in fp32 and gathered as `param_dtype`; gradients are reduced in
    `reduce_dtype`. With `cpu_offload`, sharded parameters, gradients and optimizer state
    live in CPU memory and the optimizer step runs on the CPU.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned memory only helps (and only exists) with an accelerator to copy to.
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    )
    reshard = resolve_reshard_after_forward(reshard_after_forward, pp_enabled=pp_enabled)
    common = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)

    blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    pre = [
        m for n in getattr(model, "pre_blocks", ()) if (m := getattr(model, n, None)) is not None
    ]
    post = [
        m for n in getattr(model, "post_blocks", ()) if (m := getattr(model, n, None)) is not None
    ]
    # Each pre-block module, each block, and the post-block modules together: one FSDP group
    # each, unless they share a parameter (see _fsdp_groups).
    # Expert-parallel experts first: their weights are sharded over other ranks than the rest
    # (see titan_parallel.expert_parallel), and a block's group then leaves them out.
    _shard_experts(model, reshard, common)
    units = [[m] for m in pre] + [[b] for b in blocks] + ([post] if post else [])
    last_block = blocks[-1] if blocks else None
    groups = _fsdp_groups(model, units)
    for group in groups:
        if any(m in post for m in group) or any(m is last_block for m in group):
            # The final norm and output projection are needed again at once by backward, and
            # so is the last block: keeping them gathered after forward saves a regather.
            group_reshard = False
        else:
            group_reshard = reshard
        fully_shard(
            group if len(group) > 1 else group[0], reshard_after_forward=group_reshard, **common
        )
    fully_shard(model, reshard_after_forward=reshard, **common)
    _set_prefetch([group[0] for group in groups])


def _shard_experts(model: nn.Module, reshard: bool, common: dict) -> None:
    from titan_parallel.expert_parallel import expert_shards

    for experts, shards in expert_shards(model):
        holders = shards.fsdp_mesh.shape[-1]  # ranks that split one EP rank's experts

        def placement(param: nn.Parameter, holders: int = holders, ep: int = shards.ep) -> Shard:
            # Whole experts per rank when they divide evenly, else split each along dim 1.
            return Shard(0) if (param.shape[0] // ep) % holders == 0 else Shard(1)

        fully_shard(
            experts,
            reshard_after_forward=reshard,
            shard_placement_fn=placement,
            **{**common, "mesh": shards.fsdp_mesh},
        )
        experts.set_gradient_divide_factor(shards.divide_factor)
        if shards.fsdp_mesh.device_type == "cpu" and holders > 1:
            # A divisor other than the group's size is a pre-multiplied sum, which gloo lacks:
            # sum, then divide. (Not with one holder: torch 2.15 would divide twice.)
            experts.set_force_sum_reduction_for_comms(True)


def _fsdp_groups(model: nn.Module, units: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """The FSDP groups for `units` (lists of modules, in forward order): a parameter can
    belong to one FSDP group only, so units that share one (a tied embedding and output
    projection) form one group, and a unit that shares one with a module outside every unit
    is left to the root's group. Groups are in the order of their first unit."""
    parent = list(range(len(units)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}  # parameter id -> a unit holding it
    for i, unit in enumerate(units):
        for module in unit:
            for param in module.parameters():
                j = owner.setdefault(id(param), i)
                if find(j) != find(i):
                    parent[find(i)] = find(j)
    inside = {id(m) for unit in units for module in unit for m in module.modules()}
    with_root = {
        find(owner[id(p)])
        for m in model.modules()
        if id(m) not in inside
        for p in m._parameters.values()
        if p is not None and id(p) in owner
    }
    groups: dict[int, list[nn.Module]] = {}
    for i, unit in enumerate(units):
        root = find(i)
        if root not in with_root:
            groups.setdefault(root, []).extend(unit)
    return list(groups.values())


def _set_prefetch(units: list[nn.Module]) -> None:
    # Gathering the next unit while this one computes hides the all-gather behind compute;
    # FSDP only does this on its own in backward, and only one unit ahead.
    units = [u for u in units if isinstance(u, FSDPModule)]
    for this, nxt in zip(units, units[1:]):
        this.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([this])


def apply_ddp(
    model: nn.Module, mesh: DeviceMesh, *, compile_enabled: bool = False, bucket_cap_mb: int = 100
) -> None:
    """Replicate `model` over `mesh` (DDP through torch's composable `replicate`, in place;
    parameter names stay unchanged). Gradients are averaged across the mesh in backward."""
    from torch.distributed._composable.replicate import replicate

    if compile_enabled:
        # Lets compiled graphs issue gradient all-reduces from Python hooks instead of
        # splitting graphs at bucket boundaries.
        torch._dynamo.config.optimize_ddp = "python_reducer"
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)


def autocast_context(
    fsdp_enabled: bool, param_dtype: torch.dtype, device_type: str
) -> contextlib.AbstractContextManager:
    """Mixed precision for runs without FSDP (single device, DDP, TP only): autocast to
    `param_dtype` around forward. Under FSDP the `MixedPrecisionPolicy` does this instead, so
    this returns a no-op context, as it does for fp32."""
    if fsdp_enabled or param_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=param_dtype)
