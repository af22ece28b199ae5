"""The `wandb` metric sink: each logged step's scalars in a Weights & Biases run (pip install
'titan-llm-trainer[wandb]'). Project, entity, mode (online/offline) and name come from W&B's
own WANDB_* variables when set (project: titan, name: `[job] description`); its files go under
the dump folder."""

from __future__ import annotations

import os
from collections.abc import Mapping

import wandb

from titan_core import MetricRun, get_logger

log = get_logger("metrics")


class WandbSink:
    def __init__(self, run: MetricRun) -> None:
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "titan"),
            name=os.environ.get("WANDB_NAME", run.name),
            dir=run.dump_folder,
            config=dict(run.config),
        )
        log.info("Weights & Biases: run %s (%s)", self.run.name, self.run.dir)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


def build(run: MetricRun) -> WandbSink:
    """The `titan.metric_sinks` entry point `wandb`."""
    return WandbSink(run)
