"""The config sections titan-core owns: [job] and [comm]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to read options from; command-line flags override it."""
    dump_folder: str = "./outputs"
    """Folder for everything the run writes: logs, TensorBoard, checkpoints, the resolved config."""
    description: str = "Titan training job"
    """Free text describing the run, written to the log."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to compute: auto picks cuda when a GPU is visible, else cpu."""
    print_config: bool = False
    """Log the resolved config at start-up."""


@dataclass
class Comm:
    mode: Literal["default", "fake_backend"] = "default"
    """`fake_backend`: do not train; simulate the job on a fake process group and fake tensors
    and report per-rank memory (the same as `titan-train --dry-run`; torchtitan's spelling)."""
    init_timeout_seconds: int = 300
    """Timeout for process-group set-up and every collective until the first step is done (it may compile)."""
    train_timeout_seconds: int = 100
    """Timeout for every collective after the first step: a rank that stalls or dies ends the job with an error after this many seconds instead of a hang."""
    trace_buf_size: int = 20000
    """Collectives each rank's flight recorder keeps (0 turns it off); written to the dump folder's comm_traces/ when a collective times out."""

    def validate(self) -> list[str]:
        problems = []
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            if getattr(self, key) <= 0:
                problems.append(
                    f"[comm] {key} = {getattr(self, key)} is not valid\nuse a positive number of seconds"
                )
        return problems
