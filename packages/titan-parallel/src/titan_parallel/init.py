"""Initialise a sharded model with exactly the values one unsharded process would give it.

DTensor random initialisation on each shard does not reproduce a single-process
initialisation (each rank draws its own stream), so a sharded run would start from different
weights than its 1-process reference and could not be compared to it, or resumed on a
different layout with the same seed.

`init_weights_exact` has two ways to avoid that:
- a model with an `init_plan()` (a `titan_core.ParamInit` per parameter name) gets values
  that are a function of (seed, parameter name) only: each rank draws just the blocks of its
  own shards, one at a time, so no rank holds more than its shards plus one block, and every
  layout, pipeline stages included, starts from the same weights;
- any other model gets its own `init_weights()` called on full, plain copies of every
  parameter under `torch.manual_seed(seed)`, after which each rank keeps its shard. That needs
  the full model's memory on every rank for a moment: fine for small models; give a large one
  an `init_plan()`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_core.config import ConfigError
from titan_core.init import init_from_plan_
from titan_core.messages import shortlist


@torch.no_grad()
def init_weights_exact(
    model: nn.Module, seed: int, *, buffer_device: torch.device | None = None
) -> None:
    """Give every parameter of `model` (plain or DTensor, after `to_empty`) the values a
    single process draws with this `seed`, and rebuild its non-persistent buffers.

    Uses `model.init_plan()` and `model.init_buffers(buffer_device)` when the model has them
    (scalable), else `model.init_weights(buffer_device=...)` on full copies (see the module
    docstring). Parameter objects stay the same, so FSDP's and an optimizer's references hold.
    """
    if hasattr(model, "init_plan"):
        missing = init_from_plan_(model, model.init_plan(), seed)
        if missing:
            raise ConfigError(
                f"{type(model).__name__}.init_plan() has no rule for {shortlist(missing, 5)}"
                "\nadd a ParamInit for every parameter name (names as in the unwrapped model)"
            )
        if hasattr(model, "init_buffers"):
            model.init_buffers(buffer_device)
        return
    _init_on_full_copies(model, seed, buffer_device)


def _init_on_full_copies(model: nn.Module, seed: int, buffer_device: torch.device | None) -> None:
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
        # Every rank holds the same full tensor, so each can cut its own shard: no communication.
        shard = distribute_tensor(
            fulls[id(param)], param.device_mesh, param.placements, src_data_rank=None
        )
        param.to_local().copy_(shard.to_local())
