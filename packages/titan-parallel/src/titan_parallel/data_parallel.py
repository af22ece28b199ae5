"""Data parallel: FSDP2 (`fully_shard`), HSDP (FSDP on a 2-D replicate x shard mesh) and DDP.

FSDP wraps each block of `model.layers` on its own, so that only one block's full parameters
exist at a time, then the modules before and after the blocks, then the root (which holds
whatever is left). Gradients are averaged over the mesh (reduce-scattered for FSDP, and also
all-reduced across replicas for HSDP).
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
    for module in pre:
        fully_shard(module, reshard_after_forward=reshard, **common)
    for i, block in enumerate(blocks):
        # The last block's backward runs right after forward: keeping it gathered saves a regather.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **common)
    if post:
        # The final norm and output projection are gathered together, and are needed again
        # at once by backward, so they are never resharded after forward.
        fully_shard(post, reshard_after_forward=False, **common)
    fully_shard(model, reshard_after_forward=reshard, **common)
    _set_prefetch([*pre, *blocks, *post[:1]])


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
