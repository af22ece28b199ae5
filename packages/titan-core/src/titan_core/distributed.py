"""Process-group setup: under torchrun, or as a plain single process without it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_core.device import backend_for, local_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def init_distributed(device_type: str, timeout_seconds: float = 300.0) -> DistInfo:
    """Initialise the default process group for `device_type`.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) this joins the job. Started as a plain
    `python` process, it creates a one-process group over an in-memory store, so that code
    written for meshes and DTensors runs unchanged on one process.
    """
    backend = backend_for(device_type)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_device(device_type)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_seconds)
        if "MASTER_ADDR" in os.environ or world_size > 1:
            dist.init_process_group(backend=backend, timeout=timeout, device_id=_device_id(device))
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def _device_id(device: torch.device) -> torch.device | None:
    # Binding the group to a device lets NCCL create communicators eagerly; gloo takes none.
    return device if device.type == "cuda" else None


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size_from_env() -> int:
    """The job's process count as torchrun announces it (1 without torchrun), readable before
    any process group exists, so that configs can be checked first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank of the default process group (`flag` itself without a
    group). A collective: every rank calls it. The tensor lives where the backend needs it (CPU
    for gloo, the accelerator for NCCL)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    backend = str(dist.get_backend())
    if "gloo" in backend:
        device = torch.device("cpu")
    else:
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
