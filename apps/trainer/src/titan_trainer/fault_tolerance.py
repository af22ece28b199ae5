"""The trainer's side of TorchFT replica groups ([fault_tolerance], titan-parallel's
`ReplicaGroup`): what a step does differently (where each group's data comes from is
`titan_trainer.data.data_coordinates`).

Each replica group is a job of its own (its own torchrun, dump folder and checkpoints); the
groups train one model on different shards of the data and average their gradients every step
(or, semi-synchronously, their weights every few steps: LocalSGD, DiLoCo). A step that a
failure interrupts is discarded on every group and retried on the same batches; a group that
comes back receives the model, optimizer, schedule and step from a live one, then moves its own
data to that step. So no step is lost and no batch is read twice.

The train loop meets all of this through one object, `ReplicaSteps` (a `StepCoordinator`),
which `build_step_coordinator` returns when [fault_tolerance] enable is set.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from titan_core import get_logger
from titan_parallel import ReplicaGroup, SemiSync  # torchft (an extra) loads when one is built
from titan_trainer.checkpointing.build import replica_states
from titan_trainer.step import ALONE, StepCoordinator

log = get_logger("fault_tolerance")

WAIT_FOR_GROUPS_S = 1.0
"""Pause before attempting a step again while too few replica groups are up."""


def build_step_coordinator(
    config, info, parts, optimizer, lr_scheduler, train_state
) -> StepCoordinator:
    """How this rank's steps meet other replica groups: `ReplicaSteps` when [fault_tolerance]
    enable is set (built before the checkpoint is loaded: the replica group's step count is
    part of it), else the plain coordinator of a job alone."""
    replicas = build_replica_group(config, info, parts, optimizer, lr_scheduler, train_state)
    if replicas is None:
        return ALONE
    return ReplicaSteps(replicas, build_semi_sync(replicas, parts))


class ReplicaSteps(StepCoordinator):
    """A step of one replica group among others. Synchronous: the quorum forms at the step's
    start, the gradients are averaged over the groups before clipping, and the optimizer steps
    only if every group completed the step; a discarded step is attempted again on the same
    batches. Semi-synchronous (`semi_sync`: LocalSGD, DiLoCo): each group steps alone and the
    weights are synchronised after every few steps."""

    per_rank_data = True  # each group is a job of its own, with its own data position
    receives_peer_state = True

    def __init__(self, replicas: ReplicaGroup, semi_sync: SemiSync | None = None):
        self.replicas = replicas
        self.semi_sync = semi_sync
        self._batches: StepBatches | None = None
        self._attempted = 0
        self._recovered = 0

    def checkpoint_states(self) -> dict[str, Any]:
        states: dict[str, Any] = {"fault_tolerance": self.replicas}
        if self.semi_sync is not None and self.semi_sync.method == "diloco":
            states["diloco"] = self.semi_sync  # the last synced weights and the outer momentum
        return states

    def after_restore(self) -> None:
        if self.semi_sync is not None and not self.semi_sync.loaded:
            self.semi_sync.snapshot()  # DiLoCo starts from these weights

    def batches(self, batches: Iterator, per_step: int) -> StepBatches:
        self._batches = StepBatches(batches, per_step)  # a discarded step reads them again
        return self._batches

    @property
    def _every_step(self) -> bool:
        """Whether the groups meet at every step (not semi-synchronous)."""
        return self.semi_sync is None

    def begin(self, step: int) -> None:
        self._attempted = step
        self._recovered = len(self.replicas.recoveries)
        if self._every_step:
            self.replicas.start_step()

    def after_backward(self, params: Iterable[nn.Parameter]) -> None:
        if self._every_step:
            self.replicas.average_gradients(params)

    def should_commit(self) -> bool:
        return not self._every_step or self.replicas.should_commit()

    def settle(self, state, committed: bool) -> bool:
        assert self._batches is not None, "batches() comes before the first step"
        return settle_replica_step(
            self.replicas,
            self.semi_sync,
            self._batches,
            state,
            self._attempted,
            self._recovered,
            committed,
        )

    def groups(self) -> int:
        # Before the first quorum: every group planned.
        return self.replicas.participants() or self.replicas.config.group_size

    def metrics(self) -> dict[str, float]:
        joined = self.replicas.participants()  # in the last quorum
        return {"replica_groups": joined} if joined else {}

    def close(self) -> None:
        self.replicas.close()  # leaves the quorums; torchft's threads stop


def build_replica_group(
    config, info, parts, optimizer, lr_scheduler, train_state
) -> ReplicaGroup | None:
    """This rank's `ReplicaGroup` when [fault_tolerance] enable is set, else None. What a
    restarted group receives from a live one: weights, optimizer state, the learning-rate
    schedule and the step (not the data position: each group reads its own shard)."""
    ft = config.fault_tolerance
    if not ft.enable:
        return None
    states = replica_states(parts, optimizer)  # as the checkpoints keep them
    return ReplicaGroup(
        ft,
        {**states, "lr_scheduler": lr_scheduler, "train_state": train_state},
        device=info.device,
    )


def build_semi_sync(replicas: ReplicaGroup, parts) -> SemiSync | None:
    """LocalSGD or DiLoCo over `replicas` when [fault_tolerance] semi_sync_method asks for it,
    else None."""
    if not replicas.config.semi_sync_method:
        return None
    return SemiSync(replicas, [p for part in parts for p in part.parameters()])


def settle_semi_sync(replicas, sync, batches: StepBatches, state, attempted: int) -> bool:
    """The synchronisation after step `attempted` (a due step): run it, move the data on if this
    group received a later step from a live group, and say what a failed one means."""
    recovered = len(replicas.recoveries)
    applied = sync.sync(attempted)
    batches.commit()
    if len(replicas.recoveries) > recovered:
        log.warning(
            "replica group %d received step %d from a live replica group (it had step %d);"
            " its data moves on to match",
            replicas.config.replica_id,
            state.step,
            attempted,
        )
        batches.jump(state.step - attempted, retry=False)
    if not applied:
        kept = (
            "each group keeps its own weights until the next one"
            if sync.method == "local_sgd"
            else "every group goes back to the weights of the last synchronisation"
        )
        log.warning(
            "the %s synchronisation after step %d failed (a replica group failed, or fewer than"
            " [fault_tolerance] min_replica_size = %d are up): %s",
            sync.method,
            attempted,
            replicas.config.min_replica_size,
            kept,
        )
    return applied


def fault_tolerance_problems(config) -> list[str]:
    """What this machine lacks for [fault_tolerance] (torchft, a lighthouse address), before any
    process group exists; the section's own values are checked with the rest of the config."""
    ft = config.fault_tolerance
    if not ft.enable:
        return []
    problems = []
    if importlib.util.find_spec("torchft") is None:  # not imported here: see _torchft
        problems.append(
            "[fault_tolerance] enable = true needs torchft, which is not installed\n"
            "install it with pip install 'titan-llm-trainer[ft]', or turn fault tolerance off"
        )
    if not (ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        problems.append(
            "[fault_tolerance] enable = true needs a lighthouse, and none is named\n"
            "start one (torchft_lighthouse --bind [::]:29510 --min_replicas 1) and give its"
            " address as [fault_tolerance] lighthouse or TORCHFT_LIGHTHOUSE=http://host:29510"
        )
    return problems


class StepBatches:
    """The loader's batches, each step's kept until that step is committed: a step that fault
    tolerance discards is retried on the same batches, and a group that received a later step
    from a live group skips the batches of the steps it missed."""

    def __init__(self, batches: Iterator, per_step: int):
        self._batches = batches
        self._per_step = per_step
        self._held: list[Any] = []
        self._replay: list[Any] = []
        self.discarded_in_a_row = 0

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self):
        batch = self._replay.pop(0) if self._replay else next(self._batches)
        self._held.append(batch)
        return batch

    def commit(self) -> None:
        """The step that read the held batches was applied: they are used."""
        self._held = []

    def retry(self) -> None:
        """The step was discarded: the next one reads the same batches again."""
        self._replay = self._held + self._replay
        self._held = []

    def jump(self, steps: int, *, retry: bool) -> None:
        """After healing, this group's step counter moved on by `steps` beyond the step it was
        attempting: drop its batches and those of the steps in between, so that the next step
        reads its own. With `retry`, the step the group now stands at is to be attempted again
        (it was discarded), so its batches are the next ones."""
        if retry and steps == 0:
            self.retry()
            return
        self._held = []
        for _ in range((steps - 1 if retry else steps) * self._per_step):
            next(self._batches)


def settle_replica_step(
    replicas,
    semi_sync,
    batches: StepBatches,
    state,
    attempted: int,
    recovered: int,
    committed: bool,
) -> bool:
    """After step `attempted`: with `semi_sync`, synchronise if the step is due. Otherwise,
    after the step's vote (`committed`): keep or hand back its batches, move the data on if this
    group received a later step from a live group (`recovered` is the count of such recoveries
    before the step), and step the counter back if the step was discarded. Returns whether the
    step stands (False: attempt it again)."""
    if semi_sync is not None:
        if semi_sync.due(attempted):
            settle_semi_sync(replicas, semi_sync, batches, state, attempted)
        else:
            batches.commit()
        return True
    if len(replicas.recoveries) > recovered:
        log.warning(
            "replica group %d received step %d from a live replica group (it had step %d);"
            " its data moves on to match",
            replicas.config.replica_id,
            state.step - 1,
            attempted - 1,
        )
        batches.jump(state.step - attempted, retry=not committed)
    elif committed:
        batches.commit()
    else:
        batches.retry()
    if committed:
        if batches.discarded_in_a_row:
            log.warning(
                "step %d committed with %d replica group(s), after %d discarded attempt(s)",
                state.step,
                replicas.participants(),
                batches.discarded_in_a_row,
            )
        batches.discarded_in_a_row = 0
        return True
    cfg = replicas.config
    short = replicas.participants() < cfg.min_replica_size
    if batches.discarded_in_a_row == 0:
        why = (
            f"only {replicas.participants()} of {cfg.group_size} replica groups are up, fewer"
            f" than [fault_tolerance] min_replica_size = {cfg.min_replica_size}: waiting for"
            " more"
            if short
            else "a replica group failed during it"
        )
        log.warning(
            "step %d was discarded on every replica group (%s); attempting it again",
            state.step,
            why,
        )
    batches.discarded_in_a_row += 1
    if short:
        time.sleep(WAIT_FOR_GROUPS_S)  # waiting for groups to come back: no busy loop
    state.step -= 1
    return False
