"""Initialise a sharded model with exactly the values one unsharded process would give it.

DTensor random initialisation on each shard does not reproduce a single-process
initialisation on CPU (each rank draws its own stream), so a sharded run would start from
different weights than its 1-process reference and could not be compared to it, or resumed
on a different layout with the same seed. `init_weights_exact` instead draws the full tensors,
in the model's own order, and keeps each rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def init_weights_exact(
    model: nn.Module, seed: int, *, buffer_device: torch.device | None = None
) -> None:
    """Seed the RNG and call `model.init_weights()` with every DTensor parameter temporarily
    replaced by a full, plain tensor; then copy each rank's shard of it into the parameter in
    place (parameter objects, and so FSDP's and the optimizer's references, stay the same).

    Every rank ends up with its shard of exactly the weights a single process gets from
    `torch.manual_seed(seed); model.init_weights()`. Call it after `to_empty`. It needs the
    full model's memory on every rank for a moment; for models that do not fit, initialise
    once in a single process, save a seed checkpoint, and load that instead.
    """
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    fulls: dict[int, nn.Parameter] = {}  # by id: a tied parameter gets one full tensor
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in fulls:
                    full = torch.empty(
                        param.shape, dtype=param.dtype, device=param.to_local().device
                    )
                    fulls[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
                module._parameters[name] = fulls[id(param)]
                swapped.append((module, name, param))
    torch.manual_seed(seed)
    try:
        if buffer_device is None:
            model.init_weights()
        else:
            model.init_weights(buffer_device=buffer_device)
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param
    done: set[int] = set()
    for _, _, param in swapped:
        if id(param) in done:
            continue
        done.add(id(param))
        full = fulls[id(param)]
        # Every rank holds the same full tensor, so each can cut its own shard: no communication.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
