"""One optimizer step: zero the gradients, forward and backward over the step's microbatches,
clip, check, step. What other processes take part in a step beyond this job's own ranks (TorchFT
replica groups) comes in through a `StepCoordinator`; the plain one, a job alone, does nothing,
and `titan_trainer.fault_tolerance` holds the one for replica groups."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from titan_trainer.guards import StepGuard
from titan_trainer.metrics import StepTimer
from titan_trainer.runtime import ParallelRuntime


class StepCoordinator:
    """How a step meets the rest of the job, beyond its own ranks' collectives. This one, a job
    alone, does nothing: every step is committed, the batches are the loader's. A subclass
    (replica groups) overrides what its steps do differently; the train loop calls each method
    at its point of every step, and never asks which kind it has."""

    per_rank_data = False
    """Whether each rank's data position is checkpointed as its own (replica groups keep
    their own) rather than as one global position."""
    receives_peer_state = False
    """Whether a restarted process receives the weights and step from a live peer (so a
    restart without checkpoints need not start over)."""

    def checkpoint_states(self) -> dict[str, Any]:
        """What the checkpoint keeps of the coordinator, by name, beside the run's states."""
        return {}

    def after_restore(self) -> None:
        """Called once the weights are in place (from a checkpoint or the initialisation)."""

    def batches(self, batches: Iterator, per_step: int) -> Iterator:
        """The batches the steps read, `per_step` of them each step."""
        return batches

    def begin(self, step: int) -> None:
        """Step `step` starts (its gradients are zero, nothing is read yet)."""

    def after_backward(self, params: Iterable[nn.Parameter]) -> None:
        """Every microbatch's backward is done: before clipping."""

    def should_commit(self) -> bool:
        """Whether the optimizer may apply this step (every rank calls it, once per step)."""
        return True

    def settle(self, state, committed: bool) -> bool:
        """After the step's optimizer step (or its refusal): whether the step stands; False
        means it is attempted again (`state.step` was stepped back)."""
        return True

    def groups(self) -> int:
        """How many copies of this job trained the step (each on its own data)."""
        return 1

    def metrics(self) -> dict[str, float]:
        """What the metric line adds about the coordination."""
        return {}

    def close(self) -> None:
        """The run ends: stop whatever the coordination started."""


ALONE = StepCoordinator()


class StepOutcome(NamedTuple):
    loss: torch.Tensor
    grad_norm: torch.Tensor
    committed: bool
    """False when fault tolerance discarded the step (a replica group failed): not applied
    anywhere, to be attempted again."""


def train_step(
    runtime: ParallelRuntime,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    batches: Iterator,
    accum: int,
    timer: StepTimer,
    config,
    guard: StepGuard,
    step: int,
    *,
    coordinator: StepCoordinator = ALONE,
    mark: Callable[[str], None] | None = None,
) -> StepOutcome:
    """Forward/backward over `accum` microbatches, clip, check, step. The loss and gradient
    norm are device tensors, both reduced over every rank so that all ranks log the same
    numbers; nothing is read back to the host here (see StepGuard). The `coordinator` may
    average the gradients with other replica groups before clipping, and decides whether the
    optimizer steps (`committed`). `mark(phase)`, when given, is called as each phase ends:
    "data" (each batch on the device), "forward" and "backward" (see
    `ParallelRuntime.forward_backward`); a benchmark times the step's parts with it."""
    optimizer.zero_grad(set_to_none=True)
    coordinator.begin(step)  # a replica group's quorum forms while the forward pass runs
    total = torch.zeros((), device=runtime.device)
    for _ in range(accum):
        start = time.perf_counter()
        inputs, labels = next(batches)
        timer.data_seconds += time.perf_counter() - start
        inputs = inputs.to(runtime.device, non_blocking=True)
        labels = labels.to(runtime.device, non_blocking=True)
        if mark is not None:
            mark("data")
        total += runtime.forward_backward(model_parts, inputs, labels, 1.0 / accum, mark=mark)
    coordinator.after_backward(p for part in model_parts for p in part.parameters())
    grad_norm = runtime.clip_grad_norm(model_parts, config.training.max_norm)
    loss = runtime.reduce_loss(total)
    # Every rank of every group votes, whatever its own step looks like.
    committed = coordinator.should_commit()
    # A NaN or inf step is never applied: skipped on the device, or here.
    if committed and guard.before_step(step, loss, grad_norm, local_loss=total):
        optimizer.step()
    return StepOutcome(loss, grad_norm, committed)


def pipeline_microbatches(runtime: ParallelRuntime) -> int:
    """The pipeline schedule's microbatches per forward (1 without pipeline parallel)."""
    return runtime.pipeline.n_microbatches if runtime.pipeline is not None else 1
