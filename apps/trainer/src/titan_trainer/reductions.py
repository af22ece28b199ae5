"""What a step reduces over the job's ranks, on the device and without a read-back: the global
gradient norm (clipping over every mesh dimension), and the loss and validation sums over the
data-parallel and context-parallel ranks."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

import titan_parallel
from titan_core import ParallelDims


def clip_grad_norm(parts: list[nn.Module], max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """The global gradient norm before clipping to `max_norm` (0: no clipping), left on the
    device."""
    params = [p for part in parts for p in part.parameters()]
    return titan_parallel.clip_grad_norm_(
        params, max_norm if max_norm > 0 else float("inf"), pp_mesh=dims.mesh("pp")
    )


def reduce_sum(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """`values` summed over the data-parallel and context-parallel ranks, on the device."""
    mesh = dims.mesh("dp_cp")
    values = values.detach().float()
    if mesh is None:
        return values
    if mesh.device_type != "cpu" and values.device.type == "cpu":
        values = values.to(mesh.device_type)
    return funcol.all_reduce(values, reduceOp="sum", group=mesh)


def reduce_loss(loss: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The mean of `loss` over the data-parallel and context-parallel ranks, as a tensor on the
    device: an all-reduce, but no read-back to the host."""
    loss = loss.detach().float()
    mesh = dims.mesh("dp_cp")
    if mesh is None:
        return loss
    if mesh.device_type != "cpu" and loss.device.type == "cpu":
        loss = loss.to(mesh.device_type)
    # Sum then divide: gloo has no average reduction.
    return funcol.all_reduce(loss, reduceOp="sum", group=mesh) / mesh.size()
