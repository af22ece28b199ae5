"""Per-step metrics: one dense console line on every rank, and the same scalars from rank 0 to
each metric sink the run names (TensorBoard, Weights & Biases, or a third one: plugins of the
`titan.metric_sinks` group), and the end-of-run curves."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from titan_core import MetricRun, MetricSink, get_logger, plugins, resolve
from titan_trainer.config import Metrics
from titan_trainer.plots import (
    event_folders,
    matplotlib_missing,
    read_event_folders,
    tb_run_path,
    write_run_plots,
)

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
        f"MFU {m['mfu_pct']:.1f}%" + (" (peak too low!)" if m["mfu_pct"] > 100 else ""),
        f"mem {m['mem_peak_gib']:.1f} GiB",
        f"{m['step_time_s']:.2f} s/step",
    ]
    if "data_pct" in m:
        parts.append(f"data {m['data_pct']:.0f}%")
    if m.get("skipped_rows"):
        parts.append(f"skipped rows {m['skipped_rows']:,.0f}")
    by_source = {k.removeprefix("tokens/"): v for k, v in m.items() if k.startswith("tokens/")}
    if by_source:  # a mixture: tokens the job took from each source so far
        parts.append("tokens " + ", ".join(f"{k} {_count(v)}" for k, v in by_source.items()))
    if "max_logit" in m:  # QK-Clip: the last step's largest attention logit, before the clip
        logit = m["max_logit"]  # three digits for the small logits of a young model
        parts.append(f"maxlogit {logit:.1f}" if abs(logit) >= 10 else f"maxlogit {logit:.3g}")
    if "replica_groups" in m:
        parts.append(f"groups {m['replica_groups']:.0f}")
    if "expert_load" in m:  # mixture of experts: max / mean tokens per expert, worst layer
        layers = [v for k, v in m.items() if k.startswith("expert_load/")]
        each = f" ({' '.join(f'{v:.2f}' for v in layers)})" if 1 < len(layers) <= 16 else ""
        parts.append(f"experts max/mean {m['expert_load']:.2f}{each}")
    if "expert_rerouted_pct" in m:  # under a capacity: choices sent past their expert, worst layer
        parts.append(f"re-routed {m['expert_rerouted_pct']:.0f}%")
    if m.get("skipped_steps"):
        parts.append(f"skipped steps {m['skipped_steps']:,.0f}")
    return " | ".join(parts)


def _count(n: float) -> str:
    """1234 -> 1.2K, 5.6e6 -> 5.6M: short enough for the metrics line."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


MFU_ABOVE_100 = (
    "MFU is %.1f%%, which is impossible: the peak FLOP/s it is divided by (the `peak` line at "
    "start-up) is too low, and every MFU above 100%% in this run is wrong.\n"
    "  A peak measured while other work ran on the machine reads low. Set the device's real peak "
    "with --metrics.peak_tflops (on a CPU, the bound printed in that line), or run again on a "
    "quieter machine: the best measurement is kept."
)


class MetricsLogger:
    """Writes the metrics line (every rank) and, from rank 0, the same scalars to each metric
    sink the run names (TensorBoard and W&B are two `titan.metric_sinks` plugins; see
    `sink_names`), and the end-of-run curves."""

    def __init__(
        self,
        dump_folder: str,
        tb_folder: str,
        enable_tensorboard: bool,
        rank: int,
        *,
        enable_wandb: bool = False,
        run_name: str | None = None,
        run_config: dict | None = None,
        plots_folder: str = "",
        run_id: str = "",
        sinks: Sequence[str] = (),
        section: Metrics | None = None,
    ):
        """`section`: the run's `[metrics]`, which the sinks are given (a caller without one
        gets a section of the values passed)."""
        self.rank = rank
        self._warned_mfu = False
        self.run_name = run_name or ""
        metrics = section or Metrics(
            enable_tensorboard=enable_tensorboard,
            save_tb_folder=tb_folder,
            enable_wandb=enable_wandb,
            sinks=list(sinks),
        )
        names = sink_names(metrics)
        # The end-of-run curves (rank 0), from this process's values unless TensorBoard holds
        # earlier starts of the run (a resumed run): its events are read back.
        self.run_path = tb_run_path(os.path.join(dump_folder, tb_folder), run_id)
        self.reads_events = "tensorboard" in names
        self.plots = os.path.join(dump_folder, plots_folder) if plots_folder and rank == 0 else ""
        self.history: dict[str, dict[int, float]] = {}
        if self.plots and matplotlib_missing():
            log.info("plots: %s", matplotlib_missing())
            self.plots = ""
        self.sinks: list[MetricSink] = []
        if rank == 0:
            run = MetricRun(dump_folder, run_id, self.run_name, run_config or {}, metrics)
            self.sinks = [resolve(plugins.METRIC_SINKS, name)(run) for name in names]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # Every rank logs its line (its own log file, and the console for the ranks chosen
        # there); the scalars are written once, from rank 0.
        log.info(format_line(step, metrics))
        if self.rank == 0 and metrics.get("mfu_pct", 0.0) > 100 and not self._warned_mfu:
            self._warned_mfu = True
            log.warning(MFU_ABOVE_100, metrics["mfu_pct"])
        self.log_scalars(step, metrics)

    def log_scalars(self, step: int, metrics: dict[str, float]) -> None:
        if self.plots:
            for key, value in metrics.items():
                self.history.setdefault(key, {})[step] = float(value)
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.plots and self.history:
            self._write_plots()

    def _write_plots(self) -> None:
        """loss, throughput and memory curves as PNG; of the whole run when TensorBoard holds
        earlier starts of it (a resumed run), else of this process's steps. Never of another
        run that used the same dump folder before."""
        try:
            starts = event_folders(self.run_path) if self.reads_events else []
            resumed = len(starts) > 1
            series = read_event_folders(starts) if resumed else self.history
            written = write_run_plots(series, self.plots, self.run_name)
        except Exception as e:  # the run itself went well: say so, do not fail it here
            log.warning("plots: could not draw the curves into %s: %s", self.plots, e)
            return
        log.info("plots: %s", ", ".join(written))


def sink_names(metrics) -> list[str]:
    """The metric sinks a `[metrics]` section names, by their `titan.metric_sinks` entry
    points: `tensorboard` and `wandb` when switched on, then `sinks`."""
    named = [
        name
        for name, on in (
            ("tensorboard", metrics.enable_tensorboard),
            ("wandb", metrics.enable_wandb),
        )
        if on
    ]
    return named + [name for name in metrics.sinks if name not in named]
