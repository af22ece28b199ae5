"""The trainer's side of TorchFT replica groups ([fault_tolerance], titan-parallel's
`ReplicaGroup`): what a step does differently (where each group's data comes from is
`titan_trainer.data.data_coordinates`).

Each replica group is a job of its own (its own torchrun, dump folder and checkpoints); the
groups train one model on different shards of the data and average their gradients every step
(or, semi-synchronously, their weights every few steps: LocalSGD, DiLoCo). A step that a
failure interrupts is discarded on every group and retried on the same batches; a group that
comes back receives the model, optimizer, schedule and step from a live one, then moves its own
data to that step. So no step is lost and no batch is read twice.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

from titan_ckpt import ModelState, OptimizerState
from titan_core import get_logger

log = get_logger("fault_tolerance")

WAIT_FOR_GROUPS_S = 1.0
"""Pause before attempting a step again while too few replica groups are up."""


def build_replica_group(config, info, parts, optimizer, lr_scheduler, train_state):
    """This rank's `ReplicaGroup` when [fault_tolerance] enable is set, else None. What a
    restarted group receives from a live one: weights, optimizer state, the learning-rate
    schedule and the step (not the data position: each group reads its own shard)."""
    ft = config.fault_tolerance
    if not ft.enable:
        return None
    from titan_parallel import ReplicaGroup

    return ReplicaGroup(
        ft,
        {
            "model": ModelState(parts),
            "optimizer": OptimizerState(parts, optimizer),
            "lr_scheduler": lr_scheduler,
            "train_state": train_state,
        },
        device=info.device,
    )


def build_semi_sync(replicas, parts):
    """LocalSGD or DiLoCo over `replicas` when [fault_tolerance] semi_sync_method asks for it,
    else None."""
    if replicas is None or not replicas.config.semi_sync_method:
        return None
    from titan_parallel import SemiSync

    return SemiSync(replicas, [p for part in parts for p in part.parameters()])


def settle_semi_sync(replicas, sync, batches: StepBatches, state, attempted: int) -> bool:
    """The synchronisation after step `attempted` (a due step): run it, move the data on if this
    group received a later step from a live group, and say what a failed one means."""
    recovered = len(replicas.recoveries)
    applied = sync.sync()
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
