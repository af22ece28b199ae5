"""bench/vs_torchtitan.py's parts that need neither torchtitan nor a GPU, in this process: it
reads each framework's metrics line (Titan's as `format_line` writes it; torchtitan 0.2.2's in
the format of its `MetricsProcessor.log`, whose own output `--check` reads back where torchtitan
is installed: `uv run nox -s vs-torchtitan`), takes the medians over the chosen steps only,
judges the ratio against 1.15, writes each row's config so that Titan's loader reads the row's
settings from it, and refuses to measure without a GPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from titan_core import load_config
from titan_trainer.config import JobConfig
from titan_trainer.metrics import format_line

BENCH = Path(__file__).resolve().parents[3] / "bench" / "vs_torchtitan.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vs_torchtitan", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _torchtitan_line(step: int, tps: float, mfu: float, mem: float, colors: bool) -> str:
    """torchtitan 0.2.2's metrics line (torchtitan/components/metrics.py, MetricsProcessor.log)
    with its logger's prefix; colors as torchtitan.tools.utils.Color has them."""
    red, green, orange, turquoise, blue, cyan, magenta, reset = (
        ("\033[31m", "\033[32m", "\033[33m", "\033[36m", "\033[34m", "\033[36m", "\033[35m",
         "\033[39m") if colors else ("",) * 8
    )  # fmt: skip
    return (
        "[titan] 2026-11-26 18:00:00,000 - root - INFO - "
        f"{red}step: {step:2}  {green}loss: {3.25:8.5f}  {orange}grad_norm: {0.9:7.4f}  "
        f"{turquoise}memory: {mem:5.2f}GiB({55.2:.2f}%)  {blue}tps: {round(tps):,}  "
        f"{cyan}tflops: {590.77:,.2f}  {magenta}mfu: {mfu:.2f}%{reset}"
    )


def test_each_frameworks_metrics_line_is_read(bench):
    titan = {"loss": 4.25, "grad_norm": 0.5, "lr": 3e-4, "tokens_per_s": 51234.4,
             "tflops": 590.1, "mfu_pct": 59.7, "mem_peak_gib": 32.8, "step_time_s": 0.16}  # fmt: skip
    output = "\n".join(
        ["titan: something else | 12 tok/s", f"[rank0] {format_line(12, titan)}",
         format_line(13, {**titan, "mfu_pct": 101.0, "data_pct": 1.0})]
    )  # fmt: skip
    assert bench.parse_steps("titan", output) == [
        bench.Step(12, 51234.0, 59.7, 32.8),
        bench.Step(13, 51234.0, 101.0, 32.8),  # the "(peak too low!)" mark, data share
    ]
    lines = [_torchtitan_line(9, 50612.4, 51.03, 34.91, colors) for colors in (False, True)]
    assert (
        bench.parse_steps("torchtitan", "\n".join(lines))
        == [bench.Step(9, 50612.0, 51.03, 34.91)] * 2
    )
    assert bench.parse_steps("titan", "\n".join(lines)) == []  # each reads its own only


def test_medians_are_over_the_chosen_steps_and_the_ratio_is_judged(bench):
    # Step 1 compiles and step 21 is past the end: neither counts.
    steps = [bench.Step(1, 100.0, 1.0, 50.0), *(bench.Step(s, 1000.0 + s, 50.0 + s, 30.0 + s / 10) for s in range(5, 21)), bench.Step(21, 1.0, 0.1, 99.0)]  # fmt: skip
    summary = bench.summarize(steps, 5, 20)
    assert summary == {"steps_used": 16, "tokens_per_s": 1012.5, "mfu_pct": 62.5, "peak_gib": 32.0}
    assert bench.summarize(steps[:1], 5, 20) == {"steps_used": 0}
    results = {"torchtitan": {"tokens_per_s": 1000.0}, "titan": {"tokens_per_s": 1150.0}}
    row = bench.compare_row("4l_eager", results)
    assert (row["titan_over_torchtitan"], row["met"]) == (1.15, True)
    results["titan"]["tokens_per_s"] = 1149.0
    assert bench.compare_row("4l_eager", results)["met"] is False
    assert "met" not in bench.compare_row("4l_eager", {"titan": {"tokens_per_s": 1.0}})


def test_each_rows_config_is_read_by_titan_with_the_rows_settings(bench, tmp_path):
    for row, (flavor, ac, compiled, float8) in bench.ROWS.items():
        path = tmp_path / f"{row}.toml"
        path.write_text(bench.row_toml(row, tmp_path, 20, smoke=False))
        cmd = bench.command("titan", row, path, smoke=False)
        config = load_config(JobConfig, cmd[cmd.index("titan_trainer") + 1 :])
        assert config.model.name == "titan_cut_llama3:spec" and config.model.flavor == flavor
        assert (config.training.seq_len, config.training.local_batch_size) == (8192, 1)
        assert (config.activation_checkpoint.mode, config.compile.enable) == (ac, compiled)
        assert config.model.converters == (["quantize.linear.float8"] if float8 else [])
        assert config.quantize.linear.float8.recipe_name == "tensorwise"
        assert config.quantize.linear.float8.filter_fqns == ["output"]
        theirs = bench.command("torchtitan", row, path, smoke=False)
        assert theirs[theirs.index("--job.config_file") + 1] == str(path)  # the same file


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: it measures")
def test_without_a_gpu_it_says_so_and_writes_nothing(bench, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert bench.main(bench.parse_args(["--out", str(out)])) == 2
    said = capsys.readouterr().err
    assert "no CUDA GPU on this machine" in said and "nothing was measured" in said
    assert "`--check` runs the checks a CPU can make" in said
    assert not out.exists()
