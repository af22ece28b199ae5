"""The dry run's memory estimate against measurement: on real CPU process groups, and against
the GPU measurements of issue 31.

`bench/memory_predictor.py` runs every layout of the table in the trainer README; here three of
them run in the default suite: a pipeline (two rank roles with different memory, static stage
shapes), FSDP x TP (four processes, sharded DTensors on a 2-D mesh), and a compiled
mixture-of-experts model under full activation checkpointing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core import plugins, resolve
from titan_trainer.dry_run.accuracy import LAYOUTS, compare_layout, layout_config
from titan_trainer.plots import read_scalars

# torch.cuda.max_memory_allocated of each run on one NVIDIA H100 80GB HBM3, torch 2.11 (issue 31:
# the peak of steps 5-20; bench/throughput.py --fsdp-one-device for the 8B widths, tests/
# test_gpu.py's run for the debug model, whose log prints one decimal). These are the first
# calibration points of the prediction for GPUs: tests/gpu_rows.py simulates each row.
MEASURED_ON_H100_GIB = {
    "4 layers, no AC, compiled": 32.8,
    "8 layers, selective AC, compiled": 43.0,
    "8 layers, selective AC, compiled, Float8 tensorwise": 43.0,
    "4 layers, no AC, eager": 42.5,
    "debug model, bf16, eager": 1.3,
}


@pytest.mark.parametrize(
    "name",
    [
        "PP 2 (1F1B)",
        "FSDP 2 x TP 2",
        "MoE FSDP 2 + AC full compiled",
        "CP 2 ring, packed documents",
        "CP 2 all-to-all, packed documents",
    ],
)
def test_predicted_peak_is_within_10_percent_of_the_measured_peak(name):
    world, extra = LAYOUTS[name]
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    comparisons = compare_layout(name, layout_config(extra, seq_len=512, batch=8), world, vocab)
    assert len(comparisons) == (2 if "PP" in name else 1)
    for c in comparisons:
        # The simulation and the measurement use the same tracker on the same code: fake and
        # real tensors must agree (measured: 0-1.2%).
        assert abs(c.error) < 0.10, c.row()
        if "compiled" in name:
            # The real run executes the simulation's graphs eagerly, so it really allocates the
            # intermediates that inductor would fuse away: the resident set is no reference.
            continue
        # The resident set also counts what no tensor holds (gloo buffers, the allocator's own
        # pages: ~10 MiB at these sizes).
        assert abs(c.predicted - c.measured_rss) < 0.10 * c.measured_rss + 16 * 2**20, c.row()


@pytest.fixture(scope="module")
def gpu_rows() -> dict[str, dict]:
    script = Path(__file__).with_name("gpu_rows.py")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))  # the predictions and the seconds each took, for the log
    return {row["row"]: row for row in rows}


@pytest.mark.parametrize("row", list(MEASURED_ON_H100_GIB))
def test_predicted_peak_of_a_gpu_run_is_within_10_percent_of_its_measured_peak(row, gpu_rows):
    predicted = gpu_rows[row]["predicted_gib"]
    measured = MEASURED_ON_H100_GIB[row]
    # Calibration points measured on an H100 (see MEASURED_ON_H100_GIB); the bound is the
    # issue's. Errors: -1.95%, +3.71%, +3.71%, -6.15%, -0.85% (the measured figures are rounded
    # to 0.1 GiB: +-0.15% at 8B widths, +-3.8% for the debug model).
    assert abs(predicted - measured) / measured < 0.10, (row, predicted, measured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("row", [r for r in MEASURED_ON_H100_GIB if "debug" not in r])
def test_dry_run_of_an_8b_row_against_cuda_max_memory_allocated(row, tmp_path):
    """Each 8B-width row as `titan-train` runs it on this GPU (float32 parameters under bf16
    autocast, the embedded corpus and byte tokenizer: no download), against the dry run of the
    same config; tests/test_gpu.py does the same for the debug model."""
    from conftest import run_cli
    from gpu_rows import ROWS

    from titan_core import load_config
    from titan_trainer.config import JobConfig
    from titan_trainer.dry_run import simulate_rank

    args = [*ROWS[row], "--model.tokenizer_path", "byte", "--training.dataset", "pydocs",
            "--job.dump_folder", str(tmp_path)]  # fmt: skip
    config = load_config(JobConfig, args)
    predicted = simulate_rank(config, 1, 0, _byte_vocab(), "every rank").step.total / 2**30
    result = run_cli(
        [*args, "--job.device", "cuda", "--training.steps", "4", "--metrics.log_freq", "1"],
        env_extra={"PYTHONPATH": str(Path(__file__).parent)},
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # torch.cuda.max_memory_allocated of each step (the trainer resets the peak at every
    # logged step), as TensorBoard keeps it (float32: exact to 1e-7; the metric line rounds
    # to 0.1 GiB). The steps after the first: the first also compiles and creates AdamW's
    # state.
    peaks = read_scalars(str(tmp_path / "tb"))["mem_peak_gib"]
    measured = max(peak for step, peak in peaks.items() if step > 1)
    assert abs(predicted - measured) / measured < 0.10, (row, predicted, measured)


def _byte_vocab() -> int:
    return resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
