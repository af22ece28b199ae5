"""Gradient-norm clipping and metric reduction that see every rank's share of the model.

Under FSDP, TP, EP and PP each rank holds a different part of each gradient, and gradients
live on different meshes (1-D FSDP for a norm weight, 2-D FSDP x TP for a linear, FSDP x EP
(x TP) for the experts of a mixture-of-experts layer, one mesh per pipeline stage). The true norm is computed per mesh group with DTensor (which reduces over
that mesh), combined across groups, and summed across pipeline stages through `pp_mesh`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _grads(parameters: Iterable[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


def _group_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    with _quiet_sequential_reductions():
        return _mesh_norm(grads, norm_type, foreach)


def _mesh_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if not isinstance(norm, DTensor):
        return norm
    # A DTensor norm over sharded grads is Partial; full_tensor() reduces it over its mesh,
    # on the mesh's device: gradients offloaded to the CPU under a GPU mesh give a CPU norm,
    # which NCCL cannot reduce.
    mesh, local = norm.device_mesh, norm.to_local()
    if local.device.type != mesh.device_type:
        local = local.to(mesh.device_type)
        norm = DTensor.from_local(local, mesh, norm.placements, run_check=False)
    return norm.full_tensor()


@contextlib.contextmanager
def _quiet_sequential_reductions():
    # Expert weights live on a mesh of several data-parallel views (ep_shard x ep, see
    # titan_core.ParallelDims), over which DTensor reduces a norm in one all-reduce per mesh
    # dimension and warns, every step, that a flattened mesh would take one. For a scalar the
    # extra all-reduce costs nothing; the warning would only fill the logs.
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet = _DropMessages("While redistributing from")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def total_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The norm of all gradients of `parameters` taken together, across every rank."""
    norm_type = float(norm_type)
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in _grads(parameters):
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    if groups:
        norms = [_group_norm(gs, norm_type, foreach) for gs in groups.values()]
        device = norms[0].device
        norms = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
        total = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    else:
        # No gradients here; a pipeline rank still joins the stages' reduction below, with a
        # tensor on the mesh's device (NCCL reduces GPU tensors only).
        total = torch.zeros((), device=pp_mesh.device_type if pp_mesh is not None else "cpu")
    if pp_mesh is not None:
        # Each pipeline stage holds different parameters: combine the stages' parts.
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=pp_mesh.get_group())
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most `max_norm`; return the
    global norm before clipping (a plain tensor, identical on every rank).

    Works for plain, FSDP, TP and mixed-mesh DTensor gradients. Under pipeline parallel pass
    `pp_mesh` so that every stage's gradients count.
    """
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
    total = total_grad_norm(parameters, norm_type, pp_mesh=pp_mesh, foreach=foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "training has diverged (lower the learning rate, or check the data)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in _grads(parameters):
        local = g.to_local() if isinstance(g, DTensor) else g  # shares storage with g
        by_device[local.device].append(local)
    for device, locals_ in by_device.items():
        torch._foreach_mul_(locals_, coef.to(device))
    return total


def _reduce(x: torch.Tensor | float, mesh: DeviceMesh | None, op: str) -> float:
    if isinstance(x, DTensor):
        x = x.full_tensor()
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(float(x))
    if mesh is None:
        return x.detach().to(torch.float32).item()
    # On the mesh's device whatever the caller passed (NCCL reduces GPU tensors only).
    x = x.detach().to(device=mesh.device_type, dtype=torch.float32)
    return funcol.all_reduce(x, reduceOp=op, group=mesh).item()


def dist_mean(x: torch.Tensor | float, mesh: DeviceMesh | None = None) -> float:
    """The mean of a scalar over the ranks of `mesh` (itself when `mesh` is None)."""
    # Sum then divide: gloo has no average reduction.
    return _reduce(x, mesh, "sum") / (mesh.size() if mesh is not None else 1)


def dist_sum(x: torch.Tensor | float, mesh: DeviceMesh | None = None) -> float:
    """The sum of a scalar over the ranks of `mesh`."""
    return _reduce(x, mesh, "sum")


def dist_max(x: torch.Tensor | float, mesh: DeviceMesh | None = None) -> float:
    """The maximum of a scalar over the ranks of `mesh`."""
    return _reduce(x, mesh, "max")
