"""Per-step metrics: one dense console line and TensorBoard scalars."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from titan_core import get_logger

log = get_logger("metrics")


@dataclass
class StepTimer:
    """Wall time of the logging window, split into data loading and the rest."""

    window_start: float = field(default_factory=time.perf_counter)
    data_seconds: float = 0.0
    tokens: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.data_seconds = 0.0
        self.tokens = 0
        self.steps = 0


def format_line(step: int, m: dict[str, float]) -> str:
    """`step   40 | loss 3.412 | grad_norm 0.87 | lr 8.0e-04 | 4,812 tok/s | 0.31 TFLOP/s | MFU 44.1% | mem 1.2 GiB | 0.85 s/step`"""
    parts = [
        f"step {step:4d}",
        f"loss {m['loss']:.4f}",
        f"grad_norm {m['grad_norm']:.3f}",
        f"lr {m['lr']:.1e}",
        f"{m['tokens_per_s']:,.0f} tok/s",
        f"{m['tflops']:.2f} TFLOP/s",
        f"MFU {m['mfu_pct']:.1f}%",
        f"mem {m['mem_peak_gib']:.1f} GiB",
        f"{m['step_time_s']:.2f} s/step",
    ]
    if "data_pct" in m:
        parts.append(f"data {m['data_pct']:.0f}%")
    if m.get("skipped_rows"):
        parts.append(f"skipped rows {m['skipped_rows']:,.0f}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes the console line (rank 0) and TensorBoard scalars (rank 0)."""

    def __init__(self, dump_folder: str, tb_folder: str, enable_tensorboard: bool, rank: int):
        self.rank = rank
        self.writer = None
        if enable_tensorboard and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            path = os.path.join(dump_folder, tb_folder, time.strftime("%Y%m%d-%H%M%S"))
            self.writer = SummaryWriter(path)
            log.info("TensorBoard: tensorboard --logdir %s", os.path.join(dump_folder, tb_folder))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.rank == 0:
            log.info(format_line(step, metrics))
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
