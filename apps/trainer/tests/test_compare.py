"""`titan-compare` and the end-of-run curves, on real TensorBoard event files written by
TensorBoard's own writer with known values (a trained run's are in test_parallel_e2e.py and
test_shipped_files.py)."""

from __future__ import annotations

import logging
import re
import struct
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

from titan_trainer.compare import main
from titan_trainer.metrics import MetricsLogger
from titan_trainer.plots import read_scalars

STEPS = [1, 2, 3, 4, 5]
LOSS_A = [5.5, 4.0, 3.0, 2.5, 2.25]
LOSS_B = [5.5, 4.01, 3.05, 2.46, 2.26]  # differences 0, +0.01, +0.05, -0.04, +0.01


def write_run(folder, loss, *, start=0, extra=True):
    with SummaryWriter(str(folder)) as writer:
        for step, value in zip(STEPS[start:], loss[start:]):
            writer.add_scalar("loss", value, step)
            if extra:
                writer.add_scalar("tokens_per_s", 1000.0 * step, step)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a / "tb" / "20250101-000000", LOSS_A)
    # b was resumed: its first start logged wrong values for steps 3-5, its second start
    # logged steps 3-5 again; the later values count.
    write_run(b / "tb" / "20250101-000000", [*LOSS_B[:2], 9.0, 9.0, 9.0])
    write_run(b / "tb" / "20250101-000100", LOSS_B, start=2)
    return a, b


def test_the_table_gives_first_last_and_largest_difference_per_metric(runs, tmp_path, capsys):
    a, b = runs
    assert read_scalars(str(b))["loss"] == pytest.approx(dict(zip(STEPS, LOSS_B)))
    plot = tmp_path / "out" / "compare.png"
    assert main([str(a), str(b), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.splitlines()
    loss = next(line for line in out if line.startswith("loss "))
    # steps 1-5 shared; first 0, last +0.01, largest +0.05 at step 3 (float32 storage)
    assert loss.split()[2:] == ["1-5", "(5)", "+0.000e+00", "+1.000e-02", "+5.000e-02", "3"]
    tokens = next(line for line in out if line.startswith("tokens_per_s "))
    assert tokens.split()[4:] == ["+0.000e+00", "+0.000e+00", "+0.000e+00", "1"]
    width, height = png_size(plot)
    assert width >= 900 and height >= 350  # two metrics side by side, each with its differences


def test_a_tolerance_fails_the_command_with_the_metric_step_and_size(runs, capsys):
    a, b = runs
    assert main([str(a), str(b), "--plot", "", "--tolerance", "0.06"]) == 0
    assert "within tolerance 0.06: loss" in capsys.readouterr().out
    assert main([str(a), str(b), "--plot", "", "--tolerance", "0.03"]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"titan-compare: loss of {b} differs from {a} by +5.000e-02 at step 3, above the "
        "tolerance 0.03\n"
    )
    # Relative: 0.05 / 3.0 at step 3 is the largest.
    assert main([str(a), str(b), "--plot", "", "--relative", "--tolerance", "0.0166"]) == 1
    assert main([str(a), str(b), "--plot", "", "--relative", "--tolerance", "0.0167"]) == 0


def test_missing_scalars_and_metrics_are_named(runs, tmp_path, capsys):
    a, b = runs
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(a), str(empty)]) == 2
    assert f"titan-compare: error: {empty} holds no TensorBoard scalars" in capsys.readouterr().err
    write_run(tmp_path / "c", LOSS_A, extra=False)
    assert main([str(a), str(tmp_path / "c"), "--metric", "tokens_per_s"]) == 2
    assert capsys.readouterr().err == (
        f"titan-compare: error: tokens_per_s is not logged by {tmp_path / 'c'}\n"
        "       metrics every run logged: loss\n"
    )


def test_every_run_ends_with_its_curves_as_png(tmp_path):
    logger = MetricsLogger(str(tmp_path), "tb", False, 0, plots_folder="plots")
    for step, loss in zip(STEPS, LOSS_A):
        logger.log_scalars(step, {"loss": loss, "tokens_per_s": 10.0 * step, "mem_peak_gib": 1.0})
    logger.log_scalars(5, {"validation_loss": 2.5})
    logger.close()
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "loss.png",
        "memory.png",
        "throughput.png",
    ]
    assert png_size(tmp_path / "plots" / "loss.png") == (700, 400)


def test_without_matplotlib_the_curves_are_off_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # Python's way to make it unimportable
    # Listen on the titan logger itself: it may not propagate (init_logging turns that off).
    titan = logging.getLogger("titan")
    records: list[logging.LogRecord] = []
    listener = logging.Handler()
    listener.emit = records.append
    # setLevel, not the attribute: it also clears the cached levels of the child loggers.
    level = titan.level
    titan.setLevel(logging.INFO)
    titan.addHandler(listener)
    try:
        logger = MetricsLogger(str(tmp_path), "tb", False, 0, plots_folder="plots")
        logger.log_scalars(1, {"loss": 5.0})
        logger.close()
    finally:
        titan.removeHandler(listener)
        titan.setLevel(level)
    assert not (tmp_path / "plots").exists()
    said = [r.getMessage() for r in records if "matplotlib" in r.getMessage()]
    assert said == [
        "plots: matplotlib is not installed, so no PNG curves are drawn "
        "(pip install 'titan-llm-trainer[plots]', or in the workspace: uv sync --all-packages --inexact --extra plots)"
    ]


def _logged_run(dump, run_id: str, steps, loss, *, plots: str = "") -> None:
    """One start of a run, through the trainer's own logger (TensorBoard on, rank 0)."""
    logger = MetricsLogger(str(dump), "tb", True, 0, run_id=run_id, plots_folder=plots)
    for step, value in zip(steps, loss):
        logger.log_scalars(step, {"loss": value})
    logger.close()


def test_a_fresh_run_in_a_used_folder_is_a_series_of_its_own_and_a_resume_continues_one(
    tmp_path, capsys
):
    import os
    import time

    from titan_trainer.plots import read_scalars, runs_under

    dump = tmp_path / "outputs"
    _logged_run(dump, "run-a", range(1, 21), [5.0 - 0.1 * s for s in range(1, 21)])
    time.sleep(1.1)  # a start is a folder named by the second it began
    _logged_run(dump, "run-b", [1, 3], [9.0, 8.0])  # another fresh run, same folder
    assert read_scalars(str(dump))["loss"] == {1: 9.0, 3: 8.0}  # never run-a's steps 4-20
    # The folder against the newest run's own folder: the same series.
    assert main([str(dump), str(dump / "tb/run-b"), "--plot", "", "--tolerance", "0"]) == 0
    captured = capsys.readouterr()
    assert f"{dump} holds 2 runs; reading the newest, {dump}/tb/run-b" in captured.err
    assert re.search(r"^loss .* 1-3 \(2\)", captured.out, re.M), captured.out
    # run-b resumed (its checkpoint carries its id): one series of both starts.
    time.sleep(1.1)
    _logged_run(dump, "run-b", [4, 5], [7.0, 6.5], plots="plots")
    assert read_scalars(str(dump))["loss"] == {1: 9.0, 3: 8.0, 4: 7.0, 5: 6.5}
    assert [os.path.basename(path) for path, _ in runs_under(str(dump))] == ["run-a", "run-b"]
    assert png_size(dump / "plots" / "loss.png") == (700, 400)


def test_the_comparison_plot_goes_beside_the_runs_by_default(runs, tmp_path, monkeypatch, capsys):
    a, b = runs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(a), str(b)]) == 0
    assert f"plot: {a / 'compare.png'}" in capsys.readouterr().out
    assert (a / "compare.png").is_file() and not list(elsewhere.iterdir())
    assert main([str(a), str(b), "--out", str(tmp_path / "mine.png")]) == 0
    assert (tmp_path / "mine.png").is_file()


def test_the_comparison_figure_reads_at_a_glance(tmp_path):
    # Eleven metrics, as a run logs them, two of which are 0 throughout (skipped steps and
    # rows): a grid three cells across, those two left out and named, each run's difference
    # in its own colour, whole-step ticks, and nothing clipped.
    from titan_trainer.compare_plot import comparison_figure

    names = ["loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu_pct", "mem_peak_gib",
             "step_time_s", "data_pct", "skipped_steps", "skipped_rows"]  # fmt: skip
    runs = {}
    for run, shift in (("outputs/fsdp", 0.0), ("outputs/fsdp_tp", 0.01)):
        runs[run] = {
            name: {
                s: (0.0 if name.startswith("skipped") else i + 1 + s * 0.1 + shift) for s in STEPS
            }
            for i, name in enumerate(names)
        }
    drawn = comparison_figure(runs, names, "outputs/fsdp")
    assert drawn.left_out == ["skipped_steps", "skipped_rows"]
    assert drawn.drawn == names[:9]
    figure = drawn.figure
    width, height = figure.get_size_inches() * figure.dpi
    assert width >= 1200 and height <= 1.5 * width, (width, height)  # 3 x 3 cells, not a strip
    assert figure._suptitle.get_text() == (
        "difference from fsdp; all 0, not drawn: skipped_steps, skipped_rows"
    )
    figure.draw_without_rendering()  # lays it out as savefig does
    frame = figure.bbox
    grid = [a for a in figure.axes if a.get_visible()]
    assert len(grid) == 2 * 9
    pairs = [
        (v, d) for v in grid for d in grid if d.get_shared_x_axes().joined(v, d) and v is not d
    ]
    pairs = [(v, d) for v, d in pairs if v.get_title()]  # (curves, differences) of each metric
    assert len(pairs) == 9
    for values, diffs in pairs:
        run_colours = [line.get_color() for line in values.lines]
        assert [line.get_color() for line in diffs.lines if line.get_marker() == "."] == (
            run_colours[1:]
        ), values.get_title()
        for ax in (values, diffs):
            ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            assert all(re.fullmatch(r"\d+", t) for t in ticks), ticks
        label = diffs.yaxis.label.get_window_extent()
        assert label.x0 >= frame.x0 and label.y0 >= frame.y0 and label.y1 <= frame.y1
    assert [t.get_text() for t in pairs[0][0].get_legend().get_texts()] == ["fsdp", "fsdp_tp"]
