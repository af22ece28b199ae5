"""`python -m lr_probe ARGS` is `titan-train ARGS` that also appends, before every optimizer
step, the learning rate that step runs at (`param_groups[0]["lr"]`, the value the optimizer
reads) to the file named by $TITAN_TEST_LR_FILE, one number a line."""

from __future__ import annotations

import os
import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

from titan_trainer.cli import main


def _from_state_dict_init() -> bool:
    """torch's DCP `_init_optim_state` runs one step at lr 0 to create the optimizer state
    before a checkpoint is loaded into it: not a training step."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_init_optim_state":
            return True
        frame = frame.f_back
    return False


def record_lr(optimizer, args, kwargs) -> None:
    if not _from_state_dict_init():
        with open(os.environ["TITAN_TEST_LR_FILE"], "a") as f:
            f.write(f"{float(optimizer.param_groups[0]['lr'])!r}\n")


if __name__ == "__main__":
    register_optimizer_step_pre_hook(record_lr)
    sys.exit(main())
