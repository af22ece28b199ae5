"""Learning-rate schedule: linear warm-up, a stable plateau, then a decay (warmup-stable-decay).

With `decay_ratio` unset the decay spans every step after warm-up (the classic warm-up + decay).
The factor multiplies the optimizer's peak `lr`; step s (0-based) is the s+1-th optimizer step:

    warm-up   s < W:          (s + 1) / (W + 1)            never exactly zero
    stable    s < W + S:      1
    decay     otherwise:      p = (s - W - S + 1) / D, in (0, 1]; the last step reaches p = 1
                              min + (1 - min) * curve(p), curve = 1 - p | 1 - sqrt(p) | (1 + cos(pi p)) / 2
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

_CURVES = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def schedule_phases(
    total_steps: int, warmup_steps: int, decay_ratio: float | None
) -> tuple[int, int, int]:
    """(warmup, stable, decay) step counts that add up to `total_steps`."""
    warmup = min(warmup_steps, total_steps)
    rest = total_steps - warmup
    decay = rest if decay_ratio is None else min(rest, round(total_steps * decay_ratio))
    return warmup, rest - decay, decay


def lr_factor(
    step: int,
    *,
    warmup: int,
    stable: int,
    decay: int,
    decay_type: str = "linear",
    min_lr_factor: float = 0.0,
) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < warmup + stable or decay == 0:
        return 1.0
    progress = min(1.0, (step - warmup - stable + 1) / decay)
    return min_lr_factor + (1.0 - min_lr_factor) * _CURVES[decay_type](progress)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> LambdaLR:
    """A LambdaLR over `optimizer` following `cfg` ([lr_scheduler]) for `total_steps` steps."""
    warmup, stable, decay = schedule_phases(total_steps, cfg.warmup_steps, cfg.decay_ratio)
    factor = partial(
        lr_factor,
        warmup=warmup,
        stable=stable,
        decay=decay,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return LambdaLR(optimizer, factor)
