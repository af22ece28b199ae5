"""A built run's checkpoints: loading the newest at the start, saving each one that is due
(and a full one on SIGTERM), the seed checkpoint, what Ctrl-C leaves to resume from, and
finishing the in-flight save however the run ends."""

from __future__ import annotations

from dataclasses import dataclass

from titan_core import Checkpointer, get_logger
from titan_trainer.checkpointing.plan import CheckpointPlan

log = get_logger("train")


@dataclass
class RunCheckpoints:
    """What the run does with checkpoints (`plan`) and the checkpointer plugin doing it (None
    when the plan needs none)."""

    plan: CheckpointPlan
    checkpointer: Checkpointer | None
    config: object
    """The `[checkpoint]` section (its `load_step` and `interval`)."""

    def load(self) -> int | None:
        """The step restored from the newest complete checkpoint (or `initial_load_path`), or
        None when the run loads none (a step of 0 is a seed checkpoint: nothing resumed)."""
        if self.checkpointer is None or not self.plan.loads:
            return None
        return self.checkpointer.load(self.config.load_step)

    def save_if_due(self, step: int, *, last: bool, preempted: bool) -> None:
        """The checkpointer decides whether a step is due; a preemption save is a full,
        resumable one, never the last step's export."""
        saving = self.checkpointer is not None and self.plan.saves
        if preempted:
            if saving:
                log.warning("SIGTERM: saving a full checkpoint at step %d and stopping", step)
            else:
                log.warning(
                    "SIGTERM: stopping at step %d without a checkpoint (checkpoint.enable is false)",
                    step,
                )
        if saving:
            self.checkpointer.save(step, last_step=last, force=preempted and not last)

    def write_seed(self) -> None:
        """The seed checkpoint (step 0, the initial weights), then the checkpointer closed."""
        self.checkpointer.save(0, last_step=True)
        self.checkpointer.close()
        log.info(
            "seed checkpoint written; start training without --checkpoint.create_seed_checkpoint"
        )

    def after_interrupt(self, step: int, start_step: int) -> str:
        return after_interrupt(self.config, step, start_step)

    def close(self, *, after_error: bool) -> None:
        """Finish the in-flight save. After an error a peer may be gone, and closing (it may
        wait on the other ranks) can fail too: that failure is logged, not raised, so that the
        error reported is the one that ended the run."""
        if self.checkpointer is None:
            return
        if not after_error:
            self.checkpointer.close()
            return
        try:
            self.checkpointer.close()
        except Exception as e:  # the run's own error is already on its way out
            log.warning(
                "the checkpointer could not finish after the error (%s); the newest complete"
                " checkpoint is unaffected",
                str(e).splitlines()[0][:200],
            )


def after_interrupt(ckpt, step: int, start_step: int) -> str:
    """What Ctrl-C after `step` leaves to resume from, for a run that started at `start_step`
    with `ckpt` ([checkpoint]): the newest checkpoint it saved (every `interval` steps; one
    in flight is committed as the run closes), else the one it resumed from, else nothing,
    and then its steps are lost."""
    if not CheckpointPlan.of(ckpt).saves:
        return (
            f"Ctrl-C: stopped at step {step} without a checkpoint (checkpoint.enable is false):"
            f" a rerun starts again at step 0"
        )
    saved = step - step % ckpt.interval
    if saved > start_step:
        return (
            f"Ctrl-C: stopped at step {step}; a rerun resumes from the checkpoint of step {saved}"
        )
    if start_step > 0:
        return (
            f"Ctrl-C: stopped at step {step}, before this run's first checkpoint (due at step"
            f" {saved + ckpt.interval}): a rerun resumes from step {start_step}, where this"
            " run started"
        )
    return (
        f"Ctrl-C: stopped at step {step}, before the first checkpoint (due at step"
        f" {ckpt.interval}, [checkpoint] interval): there is none to resume from, and a rerun"
        " starts again at step 0"
    )
