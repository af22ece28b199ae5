"""Whether a run checkpoints, decided once from its `[checkpoint]` section: every other module
asks the `CheckpointPlan` instead of reading the section's switches itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPlan:
    """What a run does with checkpoints."""

    seed: bool
    """It writes a model-only `step-0` checkpoint and stops (`create_seed_checkpoint`)."""
    saves: bool
    """It saves every `interval` steps and at the last one, and resumes from its newest
    (`enable`; never in a seed run, which trains nothing)."""
    starts_from: bool
    """It names a checkpoint to start from when its folder holds none (`initial_load_path`)."""

    @classmethod
    def of(cls, ckpt) -> CheckpointPlan:
        """The plan of a `[checkpoint]` section (titan-ckpt's `Checkpoint`)."""
        return cls(
            seed=ckpt.create_seed_checkpoint,
            saves=ckpt.enable and not ckpt.create_seed_checkpoint,
            starts_from=bool(ckpt.initial_load_path),
        )

    @property
    def needs_checkpointer(self) -> bool:
        """Whether the run builds the checkpointer plugin: it saves, loads or seeds."""
        return self.seed or self.saves or self.starts_from

    @property
    def writes(self) -> bool:
        """Whether the run writes checkpoints, so that their folder must take writes."""
        return self.seed or self.saves

    @property
    def loads(self) -> bool:
        """Whether the run loads a checkpoint when there is one: its newest, or the one it
        starts from (a seed run loads nothing)."""
        return not self.seed and (self.saves or self.starts_from)
