"""`titan-compare`'s figure: the runs' curves side by side, read at a glance.

Each metric is a cell of a grid (three across at most): its curves on top, one colour per run,
and under them each run's difference from the reference in that run's colour. Step ticks are
whole steps. A metric that is 0 at every step of every run (a count that never happened, such
as skipped steps) gets no cell; the figure's title names those left out. Needs matplotlib.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from titan_trainer.plots import Series

COLUMNS = 3
CELL = (4.6, 3.6)
"""Width and height of one metric's cell, in inches (100 dpi)."""


@dataclass
class Comparison:
    """What was drawn: the figure, the metrics with a cell, and those left out (all 0)."""

    figure: object
    drawn: list[str]
    left_out: list[str]


def comparison_figure(
    runs: Mapping[str, Series], metrics: Sequence[str], reference: str
) -> Comparison:
    """The figure of `metrics` for `runs` against `reference` (a key of `runs`)."""
    # matplotlib is an extra ([plots]), imported when a figure is drawn; no pyplot: no GUI
    # backend, no global state.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    drawn = [m for m in metrics if _ever_nonzero(runs, m)] or list(metrics[:1])
    left_out = [m for m in metrics if m not in drawn]
    columns = min(COLUMNS, len(drawn))
    rows = math.ceil(len(drawn) / columns)
    figure = Figure(
        figsize=(CELL[0] * columns, CELL[1] * rows + 0.5), dpi=100, layout="constrained"
    )
    labels = _labels(list(runs))
    figure.suptitle(
        "difference from " + labels[reference]
        + (f"; all 0, not drawn: {', '.join(left_out)}" if left_out else "")
    )  # fmt: skip
    colours = {name: f"C{i}" for i, name in enumerate(runs)}
    grid = figure.subplots(2 * rows, columns, squeeze=False, height_ratios=[3, 1.4] * rows)
    for index, metric in enumerate(drawn):
        row, column = 2 * (index // columns), index % columns
        values, diffs = grid[row][column], grid[row + 1][column]
        values.sharex(diffs)
        values.tick_params(labelbottom=False)  # the steps are read under the differences
        values.set_title(metric, fontsize="medium")
        base = runs[reference].get(metric, {})
        for name, series in runs.items():
            curve = series.get(metric, {})
            steps = sorted(curve)
            values.plot(
                steps,
                [curve[s] for s in steps],
                marker=".",
                color=colours[name],
                label=labels[name],
            )
            if name != reference:
                shared = sorted(set(curve) & set(base))
                diffs.plot(
                    shared, [curve[s] - base[s] for s in shared], marker=".", color=colours[name]
                )
        if index == 0:
            values.legend(fontsize="small")
        diffs.axhline(0.0, color=colours[reference], linewidth=0.8)
        diffs.set_ylabel("difference", fontsize="small")
        diffs.set_xlabel("step")
        for axes in (values, diffs):
            axes.grid(alpha=0.3)
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.tick_params(labelsize="small")
    for index in range(len(drawn), rows * columns):  # an empty cell in the last row
        row, column = 2 * (index // columns), index % columns
        grid[row][column].set_visible(False)
        grid[row + 1][column].set_visible(False)
    return Comparison(figure, drawn, left_out)


def write_comparison_plot(
    runs: Mapping[str, Series], metrics: Sequence[str], path: str, reference: str
) -> Comparison:
    """`comparison_figure` written to the PNG `path`."""
    drawn = comparison_figure(runs, metrics, reference)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    drawn.figure.savefig(path)
    return drawn


def _ever_nonzero(runs: Mapping[str, Series], metric: str) -> bool:
    return any(value != 0 for series in runs.values() for value in series.get(metric, {}).values())


def _labels(names: list[str]) -> dict[str, str]:
    """Each run by the shortest tail of its folder path that tells it from the others."""
    parts = {name: os.path.normpath(name).split(os.sep) for name in names}
    for depth in range(1, max(len(p) for p in parts.values()) + 1):
        tails = {name: os.sep.join(p[-depth:]) for name, p in parts.items()}
        if len(set(tails.values())) == len(names):
            return tails
    return {name: name for name in names}
