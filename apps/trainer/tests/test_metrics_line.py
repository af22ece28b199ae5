"""The metrics line never shows an MFU above 100% without saying loudly that the peak is wrong."""

from __future__ import annotations

from titan_core import init_logging
from titan_trainer.metrics import MetricsLogger, format_line

LINE = {
    "loss": 4.25,
    "grad_norm": 0.5,
    "lr": 1e-3,
    "tokens_per_s": 3000.0,
    "tflops": 0.1,
    "mem_peak_gib": 1.0,
    "step_time_s": 0.5,
}


def test_mfu_above_100_percent_is_marked_and_warned_about_once(tmp_path, capsys):
    init_logging(rank=0)
    metrics = MetricsLogger(str(tmp_path), "tb", enable_tensorboard=False, rank=0)
    metrics.log(1, {**LINE, "mfu_pct": 58.3})
    out = capsys.readouterr().out
    assert "MFU 58.3% |" in out and "WARNING" not in out
    metrics.log(2, {**LINE, "mfu_pct": 113.2})
    metrics.log(3, {**LINE, "mfu_pct": 131.9})
    out = capsys.readouterr().out
    assert "MFU 113.2% (peak too low!)" in out and "MFU 131.9% (peak too low!)" in out
    assert out.count("WARNING") == 1  # loud once, marked on every line
    assert "MFU is 113.2%, which is impossible" in out and "--metrics.peak_tflops" in out


def test_mfu_of_exactly_100_percent_is_not_marked():
    assert "(peak too low!)" not in format_line(1, {**LINE, "mfu_pct": 100.0})


def test_a_mixture_shows_the_tokens_of_each_source():
    line = format_line(1, {**LINE, "mfu_pct": 1.0, "tokens/c4": 1.25e6, "tokens/code": 4.0e5})
    assert line.endswith("| tokens c4 1.2M, code 400.0K")
