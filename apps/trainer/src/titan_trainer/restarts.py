"""What a job restarted by `torchrun --max-restarts` starts from, said in the log: which attempt
this is and the step it resumes at, and, before any restart, a warning when one could only
start over."""

from __future__ import annotations

import logging

from titan_core import get_logger
from titan_trainer.comm import torchrun_restarts
from titan_trainer.run import Run

log = get_logger("train")


def note_torchrun_restart(run: Run, loaded: int | None) -> None:
    """Under `torchrun --max-restarts`, say which attempt this is and where it starts; warn
    when a restart could only start over (no checkpoints)."""
    done, allowed = torchrun_restarts()
    if not allowed:
        return
    notice = restart_notice(
        allowed, run.checkpoints.plan.needs_checkpointer, run.coordinator.receives_peer_state
    )
    if notice is not None:
        log.log(*notice)
    if done:
        log.warning(
            "torchrun restart %d of %d: training goes on from step %d (%s)",
            done,
            allowed,
            run.state.step,
            "the newest complete checkpoint" if loaded else "no checkpoint to resume from",
        )


def restart_notice(
    allowed: int, checkpointing: bool, fault_tolerance: bool
) -> tuple[int, str] | None:
    """(log level, text) of what a torchrun restart of this job will start from, when that
    is worth saying: without checkpoints a restart starts over, unless a live replica group
    (fault tolerance) hands the restarted group its step."""
    if checkpointing:
        return None
    if fault_tolerance:
        return logging.INFO, (
            f"torchrun may restart this replica group {allowed} time(s) (--max-restarts); without"
            " checkpoints a restarted group receives the weights, optimizer state and step from a"
            " live replica group, and the job starts over from step 0 only if every group is lost"
            " at once ([checkpoint] enable = true covers that too)"
        )
    return logging.WARNING, (
        f"torchrun may restart this job {allowed} time(s) (--max-restarts), but [checkpoint]"
        " enable = false: a restart trains again from step 0; turn checkpoints on so that one"
        " loses at most [checkpoint] interval steps"
    )
