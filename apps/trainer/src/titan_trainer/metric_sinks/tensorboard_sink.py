"""The `tensorboard` metric sink: each logged step's scalars as TensorBoard events, under
`<dump folder>/<[metrics] save_tb_folder>/<run id>/<start time>/` (one folder per run, one
subfolder per start of it; see `titan_trainer.plots`, which reads them back)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from torch.utils.tensorboard import SummaryWriter

from titan_core import MetricRun, get_logger
from titan_trainer.plots import mark_run, tb_run_path

log = get_logger("metrics")


class TensorBoardSink:
    def __init__(self, run: MetricRun) -> None:
        tb_folder = os.path.join(run.dump_folder, run.metrics.save_tb_folder)
        run_path = tb_run_path(tb_folder, run.run_id)
        if run.run_id:
            mark_run(run_path, run.run_id)
        self.writer = SummaryWriter(os.path.join(run_path, time.strftime("%Y%m%d-%H%M%S")))
        log.info("TensorBoard: tensorboard --logdir %s", tb_folder)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def build(run: MetricRun) -> TensorBoardSink:
    """The `titan.metric_sinks` entry point `tensorboard`."""
    return TensorBoardSink(run)
