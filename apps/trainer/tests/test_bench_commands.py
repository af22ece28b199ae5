"""The benchmark commands users run: `uv run nox -s bench-gpu` refuses clearly on a machine
without a GPU, and its parts (throughput with the step breakdown, Float8, checkpoints) run end
to end at toy sizes (`--smoke`) into the one JSON file the GPU run writes."""

from __future__ import annotations

import json
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
