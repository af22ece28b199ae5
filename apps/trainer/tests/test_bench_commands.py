"""The benchmark commands users run: `uv run nox -s bench-gpu` refuses clearly on a machine
without a GPU, and its parts (throughput with the step breakdown, Float8, checkpoints) run end
to end at toy sizes (`--smoke`) into the one JSON file the GPU run writes; `uv run nox -s bench`
reaches every CPU script; bench/README.md's throughput commands run as shown, with toy sizes
appended (argparse keeps the last value of a flag)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="this machine has a CUDA GPU: bench-gpu measures here"
)
def test_bench_gpu_without_a_gpu_says_so_and_fails_without_writing_a_file(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(REPO / "noxfile.py"), "-s", "bench-gpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = done.stdout + done.stderr  # nox passes the command's stderr on to its stdout
    assert done.returncode != 0
    assert "no CUDA GPU on this machine" in said, said[-2000:]
    assert "nothing was measured and no file was written" in said
    assert "uv run nox -s bench`" in said  # what to run instead
    assert not list(tmp_path.glob("*.json"))


def test_bench_gpu_smoke_runs_every_part_into_one_file(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True
    parts = report["parts"]
    assert {"throughput", "float8", "ckpt"} <= set(parts)
    assert all(p["returncode"] == 0 for p in parts.values())
    (throughput,) = parts["throughput"]["records"]
    # The breakdown covers the whole step: its parts add up to about the median step.
    breakdown = throughput["breakdown_s"]
    assert set(breakdown) == {"data", "forward", "backward", "optimizer", "logging"}
    assert all(v >= 0 for v in breakdown.values())
    assert throughput["mfu_pct"] > 0 and throughput["peak_tflops"] > 0
    assert throughput["drift"] > 0
    metrics = {r["metric"] for r in parts["ckpt"]["records"]}
    assert {"sync_save_s", "async_blocking_s", "load_s"} <= metrics
    (float8,) = parts["float8"]["records"]
    assert float8.get("skipped") is (not torch.cuda.is_available())


def test_nox_bench_runs_every_cpu_script(tmp_path):
    # `--` passes `--help` on to each script: every one is reached and parses its flags, without
    # the minutes the measurements themselves take.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nox",
            "-f",
            str(REPO / "noxfile.py"),
            "-s",
            "bench",
            "--",
            "--help",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    scripts = sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name != "gpu.py")
    usages = re.findall(r"usage: (\S+\.py)", said)
    assert sorted(usages) == scripts, usages


TOY = ["--seq-len", "64", "--batch-size", "2", "--steps", "2", "--warmup", "1"]


def _bench_readme_commands(script: str) -> list[str]:
    text = (REPO / "bench" / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.startswith(f"uv run python bench/{script}")
    ]


def test_bench_readme_throughput_commands_run_at_toy_sizes():
    commands = _bench_readme_commands("throughput.py")
    assert len(commands) == 3, commands
    for command in commands:
        argv = shlex.split(command)
        assert argv[:3] == ["uv", "run", "python"]
        done = subprocess.run(
            [sys.executable, *argv[3:], *TOY],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, command + "\n" + done.stderr[-3000:]
        records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        flags = dict(zip(argv[3::1], argv[4::1]))
        variants = flags.get("--variants", "default").split(";")
        assert [r["variant"] for r in records] == variants, command
        for record in records:
            assert record["flavor"] == flags["--flavors"]
            assert record["dtype"] == flags["--dtype"]
            assert (record["seq_len"], record["batch_size"], record["steps_timed"]) == (64, 2, 2)
            assert record["mfu_pct"] > 0 and record["tokens_per_s"] > 0
            assert set(record["breakdown_s"]) == {
                "data",
                "forward",
                "backward",
                "optimizer",
                "logging",
            }
        if len(records) == 2:  # side by side: the second carries its ratio to the first
            assert records[1]["step_time_over_first_variant"] > 0


def test_bench_readme_ckpt_command_runs_at_toy_sizes():
    (command,) = _bench_readme_commands("ckpt.py")
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "run", "python"] and "--only" in argv
    done = subprocess.run(
        [sys.executable, *argv[3:], "--mb", "16,32", "--saves", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted({r["checkpoint_mb"] for r in rows}) == [48.0, 96.0]  # each size in turn
    targets = {(r["checkpoint_mb"], r["metric"]): r for r in rows if "target" in r}
    assert {metric for _, metric in targets} == {
        "checksummed_save_over_plain_save",
        "checksummed_read_over_plain_read",
        "verified_load_over_plain_load",
    }
    # Toy sizes on a shared machine: the ratios are reported, not judged, here.
    assert all(r["value"] > 0 and isinstance(r["met"], bool) for r in targets.values())
