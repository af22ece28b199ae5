"""A run's scalars read back from its TensorBoard events, and drawn as PNG curves.

A run writes its events under `<tb folder>/<run id>/<start time>/`: a fresh run gets a new run
id, a resumed one keeps the id its checkpoint carries, so a run and its resumes form one
series and an unrelated run started later in the same dump folder another (`titan_run.json`
marks each run's folder). `read_scalars(folder)` reads the newest run under a folder (a dump
folder, its TensorBoard folder, or one run's folder), every start of it (a later value of a
step replaces an earlier one); event files written before run ids count as one run. The
curves need matplotlib (`pip install 'titan-llm-trainer[plots]'`); without it
`matplotlib_missing()` says so and nothing is drawn. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Sequence

Series = dict[str, dict[int, float]]
"""metric name -> step -> value"""

MATPLOTLIB_MISSING = (
    "matplotlib is not installed, so no PNG curves are drawn "
    "(pip install 'titan-llm-trainer[plots]', or in the workspace: uv sync --all-packages"
    " --inexact --extra plots)"
)

# The curves at the end of every run: file name -> (title, metrics drawn, y label).
RUN_PLOTS = {
    "loss.png": ("loss", ("loss", "validation_loss"), "cross-entropy"),
    "throughput.png": ("throughput", ("tokens_per_s",), "tokens/s per device"),
    "memory.png": ("memory", ("mem_peak_gib",), "peak GiB"),
}


def matplotlib_missing() -> str | None:
    """Why no curves can be drawn, or None when matplotlib is there."""
    return None if importlib.util.find_spec("matplotlib") is not None else MATPLOTLIB_MISSING


def tb_run_path(tb_folder: str, run_id: str) -> str:
    """The folder of run `run_id`'s events under the TensorBoard folder (the folder itself for
    a run without an id)."""
    return os.path.join(tb_folder, run_id) if run_id else tb_folder


def event_folders(folder: str) -> list[str]:
    """Every folder under `folder` (itself included) that holds TensorBoard event files."""
    return sorted(
        root
        for root, _, files in os.walk(folder)
        if any(f.startswith("events.out.tfevents.") for f in files)
    )


RUN_MARKER = "titan_run.json"
"""In each run's TensorBoard folder: the run id and when it started."""


def mark_run(run_folder: str, run_id: str) -> None:
    """Mark `run_folder` as the TensorBoard folder of run `run_id` (once, by its first start)."""
    path = os.path.join(run_folder, RUN_MARKER)
    if not os.path.exists(path):
        os.makedirs(run_folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"run_id": run_id, "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)


def runs_under(folder: str) -> list[tuple[str, list[str]]]:
    """(run folder, its event folders) of every run under `folder`, the newest (by its last
    event file) last. Event folders in no marked run folder form one run, named `folder`."""
    groups: dict[str, list[str]] = {}
    for path in event_folders(folder):
        groups.setdefault(_run_folder(path, folder), []).append(path)
    return sorted(groups.items(), key=lambda item: max(map(_newest_event, item[1])))


def _run_folder(path: str, top: str) -> str:
    """The nearest folder from `path` up to (not including) `top` that holds RUN_MARKER, else
    `top`. `path` lies under `top` (as `event_folders` gives it)."""
    top, here = os.path.normpath(top), os.path.normpath(path)
    while len(here) > len(top):
        if os.path.isfile(os.path.join(here, RUN_MARKER)):
            return here
        here = os.path.dirname(here)
    return top


def _newest_event(folder: str) -> float:
    return max(
        os.path.getmtime(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.startswith("events.out.tfevents.")
    )


def read_scalars(folder: str) -> Series:
    """Every scalar of the newest run under `folder` (see the module docstring), by metric
    and step."""
    runs = runs_under(folder)
    return read_event_folders(runs[-1][1]) if runs else {}


def read_event_folders(folders: Sequence[str]) -> Series:
    """Every scalar of the event files in `folders`, by metric and step; a later value of a
    step (a resumed start's) replaces an earlier one."""
    # tensorboard's reader takes a second to import: only when events are read back.
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    rows: list[tuple[float, str, int, float]] = []
    for path in folders:
        events = EventAccumulator(path, size_guidance={SCALARS: 0})  # 0: keep every value
        events.Reload()
        for tag in events.Tags()["scalars"]:
            rows += [(e.wall_time, tag, e.step, e.value) for e in events.Scalars(tag)]
    series: Series = {}
    for _, tag, step, value in sorted(rows):  # by wall time: a resumed run's values win
        series.setdefault(tag, {})[step] = value
    return series


def _figure(title: str, ylabel: str):
    # matplotlib is an extra ([plots]), imported when a curve is drawn; no pyplot: no GUI
    # backend, no global state.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    axes = figure.subplots()
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    return figure, axes


def write_run_plots(series: Series, out_folder: str, title: str = "") -> list[str]:
    """loss.png, throughput.png and memory.png of one run into `out_folder` (those whose
    metrics the run logged), and a plot per downstream task. Needs matplotlib."""
    os.makedirs(out_folder, exist_ok=True)
    written = []
    for name, (what, metrics, ylabel) in RUN_PLOTS.items():
        drawn = [m for m in metrics if series.get(m)]
        if not drawn:
            continue
        figure, axes = _figure(f"{what}: {title}" if title else what, ylabel)
        for metric in drawn:
            steps = sorted(series[metric])
            axes.plot(steps, [series[metric][s] for s in steps], marker=".", label=metric)
        if len(drawn) > 1:
            axes.legend()
        path = os.path.join(out_folder, name)
        figure.savefig(path)
        written.append(path)
    return written + write_eval_plots(series, out_folder, title)


def write_eval_plots(series: Series, out_folder: str, title: str = "") -> list[str]:
    """eval_<task>.png for each task `[eval]` scored (its `eval/<task>/<metric>` scalars):
    accuracies on a linear scale, perplexities on a log one."""
    tasks: dict[str, list[str]] = {}
    for key in sorted(series):
        if key.startswith("eval/") and key.count("/") == 2 and series[key]:
            tasks.setdefault(key.split("/")[1], []).append(key)
    written = []
    for task, keys in tasks.items():
        figure, axes = _figure(f"{task}: {title}" if title else task, "score")
        if any("perplexity" in k for k in keys):
            axes.set_yscale("log")
        for key in keys:
            steps = sorted(series[key])
            axes.plot(steps, [series[key][s] for s in steps], marker="o", label=key.split("/")[2])
        axes.legend()
        path = os.path.join(out_folder, f"eval_{task}.png")
        figure.savefig(path)
        written.append(path)
    return written
