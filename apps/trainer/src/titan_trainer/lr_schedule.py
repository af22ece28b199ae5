"""Learning-rate schedule: linear warm-up, a stable plateau, then a decay (warmup-stable-decay).

With `decay_ratio` unset the decay spans every step after warm-up (the classic warm-up + decay).

The schedule is always the one of the current config. Resuming with another `training.steps`
(extending a run) or other `[lr_scheduler]` keys recomputes it for the new settings and applies
it from the resumed step on, the first resumed step included; so does another peak `[optimizer]
lr`. A warning gives the learning rate the old schedule would have used at that step and the one
used now (with warmup-stable-decay, a longer run lengthens the stable phase, so a run resumed
after its decay began jumps back up).
The factor multiplies the optimizer's peak `lr`; step s (0-based) is the s+1-th optimizer step:

    warm-up   s < W:          (s + 1) / (W + 1)            never exactly zero
    stable    s < W + S:      1
    decay     otherwise:      p = (s - W - S + 1) / D, in (0, 1]; the last step reaches p = 1
                              min + (1 - min) * curve(p), curve = 1 - p | 1 - sqrt(p) | (1 + cos(pi p)) / 2
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_core import SelfSchedulingOptimizer, get_logger

log = get_logger("lr_schedule")

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


def _factor_fn(total_steps: int, settings: dict):
    warmup, stable, decay = schedule_phases(
        total_steps, settings["warmup_steps"], settings["decay_ratio"]
    )
    return partial(
        lr_factor,
        warmup=warmup,
        stable=stable,
        decay=decay,
        decay_type=settings["decay_type"],
        min_lr_factor=settings["min_lr_factor"],
    )


class LRSchedule(LambdaLR):
    """LambdaLR whose checkpoint records the schedule it followed (see the module docstring).

    The learning rate of every step is a function of the current config ([optimizer] lr,
    [lr_scheduler], training.steps) and of the step alone: `apply()` writes it into the
    optimizer, and the trainer calls it before each step. Nothing loaded from a checkpoint
    decides it: DCP restores states in the order of their names, so the optimizer's
    `param_groups` (holding the saving run's lr) are loaded after this schedule, and the
    checkpoint's `base_lrs` hold the saving run's peak."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, total_steps: int):
        self.schedule = {
            "total_steps": total_steps,
            "warmup_steps": cfg.warmup_steps,
            "decay_ratio": cfg.decay_ratio,
            "decay_type": cfg.decay_type,
            "min_lr_factor": cfg.min_lr_factor,
        }
        super().__init__(optimizer, _factor_fn(total_steps, self.schedule))

    def load_state_dict(self, state_dict: dict) -> None:
        # Each group's peak is the configured one (its `initial_lr`), not the checkpoint's: a
        # group's lr may have changed, and a pipeline rank's groups are not rank 0's (whose
        # copy of this state the checkpoint keeps).
        current, peaks = dict(self.schedule), list(self.base_lrs)
        super().load_state_dict(state_dict)
        previous, self.schedule = self.schedule, current
        saved_peaks, self.base_lrs = self.base_lrs, peaks
        self.apply()
        changes = [
            f"{k} {previous.get(k)} -> {v}" for k, v in current.items() if previous.get(k) != v
        ]
        if saved_peaks != peaks:
            changes.append(f"[optimizer] lr {_peaks(saved_peaks)} -> {_peaks(peaks)}")
        if changes:
            old_factor = _factor_fn(previous["total_steps"], previous)(self.last_epoch)
            new_factor = self.lr_lambdas[0](self.last_epoch)
            log.warning(
                "the learning-rate schedule changed since the checkpoint (%s); it is recomputed"
                " for the new settings from step %d on: lr %.4g there under the old schedule"
                " (factor %.4g), %.4g under the new one (factor %.4g)",
                ", ".join(changes),
                self.last_epoch + 1,
                saved_peaks[0] * old_factor,
                old_factor,
                peaks[0] * new_factor,
                new_factor,
            )

    def apply(self) -> None:
        """Set each parameter group's lr to the schedule's value for the step about to run."""
        for group, lr in zip(self.optimizer.param_groups, self._current_lrs()):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _current_lrs(self) -> list[float]:
        return [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]


def _peaks(lrs: list[float]) -> str:
    return ", ".join(f"{lr:g}" for lr in dict.fromkeys(lrs))


def warmup_warning(cfg, total_steps: int, peak_lr: float) -> str | None:
    """What a warm-up as long as the run, or longer, does to it (torchtitan's rule: the
    warm-up is cut to the run), or None for a warm-up shorter than the run."""
    asked = cfg.warmup_steps
    if asked < total_steps or total_steps < 1:
        return None
    warmup, _, _ = schedule_phases(total_steps, asked, cfg.decay_ratio)
    top = warmup / (warmup + 1)
    what = (
        f"is longer than the run ([training] steps = {total_steps}): the warm-up is cut to the"
        f" run's {warmup} steps, so"
        if asked > total_steps
        else f"covers the whole run ([training] steps = {total_steps}):"
    )
    return (
        f"[lr_scheduler] warmup_steps = {asked} {what} the learning rate only rises, to"
        f" {warmup}/{warmup + 1} of the peak ({peak_lr * top:.2g} of [optimizer] lr ="
        f" {peak_lr:g}) at the last step, and never decays; set warmup_steps below"
        " training.steps (a tenth to a fifth of them) for a warm-up, a plateau and a decay"
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> LRSchedule:
    """The schedule over `optimizer` following `cfg` ([lr_scheduler]) for `total_steps` steps.
    A warm-up as long as the run, or longer (cut to the run), is warned about once.

    An optimizer that schedules its learning rate itself (a `SelfSchedulingOptimizer` whose
    `owns_lr_schedule` is set, as Ranger21 with its warm-up or warm-down on) gets a constant
    schedule instead: applying both would warm up (and decay) twice."""
    if isinstance(optimizer, SelfSchedulingOptimizer) and optimizer.owns_lr_schedule:
        log.info(
            "%s schedules its own learning rate (warm-up and warm-down): [lr_scheduler] is not"
            " applied; turn the optimizer's schedule off to use [lr_scheduler]",
            type(optimizer).__name__,
        )
        cfg = dataclasses.replace(cfg, warmup_steps=0, decay_ratio=0.0)
    warning = warmup_warning(cfg, total_steps, optimizer.param_groups[0]["lr"])
    if warning is not None and _first_rank():
        log.warning(warning)
    return LRSchedule(optimizer, cfg, total_steps)


def _first_rank() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
