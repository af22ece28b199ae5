"""`titan-train --dry-run` (torchtitan's `--comm.mode fake_backend`): will this job start, fit
and load its checkpoint? Answered on a laptop CPU in minutes, before a cluster is booked.

`report` runs the checks and prints the answer; `simulate` builds and steps each rank role on
fake tensors under a fake process group; `suggest` simulates changes that make a job fit;
`accuracy` measures the same build and step for real on CPU process groups, which is how the
estimate is validated (`bench/memory_predictor.py`, the trainer's tests): it ships with the
dry run so that its numbers can be checked on any machine the trainer is installed on.

Exit status: 0 the job fits, 2 a config problem, 3 it does not fit.
"""

from titan_trainer.dry_run.report import (
    EXIT_CONFIG,
    EXIT_DOES_NOT_FIT,
    EXIT_FITS,
    device_capacity_gib,
    dry_run,
    fits,
    main_dry_run,
    resolve_world_size,
)
from titan_trainer.dry_run.simulate import (
    RoleResult,
    Simulation,
    measure_rank,
    rank_roles,
    simulate,
    simulate_rank,
)
from titan_trainer.dry_run.text import gib_text

__all__ = [
    "EXIT_CONFIG",
    "EXIT_DOES_NOT_FIT",
    "EXIT_FITS",
    "RoleResult",
    "Simulation",
    "device_capacity_gib",
    "dry_run",
    "fits",
    "gib_text",
    "main_dry_run",
    "measure_rank",
    "rank_roles",
    "resolve_world_size",
    "simulate",
    "simulate_rank",
]
