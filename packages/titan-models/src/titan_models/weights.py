"""Initial weights from a model's `init_plan()`: the step every family's `init_weights` ends with."""

from __future__ import annotations

import torch
from torch import nn

from titan_core.init import init_from_plan_


def init_by_plan_(model: nn.Module, seed: int | None) -> None:
    """Fill every parameter (and planned buffer) of `model` from its `init_plan()` under `seed`
    (default: torch's current seed). A parameter the plan has no rule for is a KeyError, so a
    new layer cannot be left uninitialised."""
    seed = torch.initial_seed() if seed is None else seed
    missing = init_from_plan_(model, model.init_plan(), seed)
    if missing:
        raise KeyError(f"init_plan() has no rule for {', '.join(missing)}")
