"""Someone else's optimizer package: SGD with momentum, built from the trainer's [optimizer]
section (lr, and beta1 as the momentum). The trainer finds it by `module:attr` (or by its
`titan.optimizers` entry point once installed) and never imports it."""

from __future__ import annotations

import torch

from titan_core import OptimizerPlugin

CALLS: list[dict] = []


class SGDFactory(OptimizerPlugin):
    def __call__(self, params, config, *, total_steps, dims):
        CALLS.append({"lr": config.lr, "total_steps": total_steps, "world": dims.world_size})
        return torch.optim.SGD(params, lr=config.lr, momentum=config.beta1)

    def state_copies(self, config) -> float:
        return 1.0  # the momentum buffer


build = SGDFactory()
