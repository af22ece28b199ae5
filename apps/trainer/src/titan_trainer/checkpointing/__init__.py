"""Everything the trainer does with checkpoints, in one place: whether a run checkpoints
(`CheckpointPlan`, decided once), which checkpoint a resume loads and whether the run's
settings fit it (`resume_problems`, `resume_group_problems`: asked of the checkpointer), where
the checkpoints go and whether they fit there (`space`), the checkpointer plugin built with its
Hugging Face adapter (`build_checkpointer`), loading, saving on schedule and on signals, the
seed checkpoint and closing (`RunCheckpoints`), and the checkpoints `titan-generate` reads
(`reading`). The rest of the trainer asks it; titan-ckpt is imported nowhere else in the
trainer but for its `[checkpoint]` section in the config."""

from typing import TYPE_CHECKING

from titan_core.lazy import attach

# Each name imported from its module on first use: the plan is asked before torch's import.
if TYPE_CHECKING:
    from titan_trainer.checkpointing.build import build_checkpointer, replica_states
    from titan_trainer.checkpointing.plan import CheckpointPlan
    from titan_trainer.checkpointing.reading import (
        UnusableCheckpoint,
        find_checkpoint,
        hf_weights,
        model_weights,
    )
    from titan_trainer.checkpointing.resume import (
        loadable_problems,
        resume_point,
        resume_problems,
        saved_config,
    )
    from titan_trainer.checkpointing.resume_groups import resume_group_problems
    from titan_trainer.checkpointing.saving import RunCheckpoints, after_interrupt
    from titan_trainer.checkpointing.space import folder_to_write, space_problems, store_problems

__getattr__, __dir__ = attach(__name__, __file__)

__all__ = [
    "CheckpointPlan",
    "RunCheckpoints",
    "UnusableCheckpoint",
    "after_interrupt",
    "build_checkpointer",
    "find_checkpoint",
    "folder_to_write",
    "hf_weights",
    "loadable_problems",
    "model_weights",
    "replica_states",
    "resume_group_problems",
    "resume_point",
    "resume_problems",
    "saved_config",
    "space_problems",
    "store_problems",
]
