"""What only a GPU can show. Marked `gpu`: they run when a CUDA device is visible and are
reported as skipped, with the reason, on a CPU-only machine."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import DEBUG_TOML, run_cli


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_is_written_on_cuda(tmp_path):
    result = run_cli(
        [
            "--job.config_file",
            str(DEBUG_TOML),
            "--job.dump_folder",
            str(tmp_path),
            "--job.device",
            "cuda",
            "--training.seq_len",
            "128",
            "--training.steps",
            "2",
            "--profiling.enable_memory_snapshot",
            "--profiling.save_memory_snapshot_folder",
            "snapshots",
        ]
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    snapshot = tmp_path / "snapshots" / "rank0_memory_snapshot.pickle"
    assert snapshot.is_file()
    assert "segments" in pickle.loads(snapshot.read_bytes())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dry_run_prediction_against_cuda_max_memory_allocated(tmp_path):
    """The dry run's estimate against what the CUDA caching allocator counts, on one GPU."""
    from titan_core import load_config, plugins, resolve
    from titan_trainer.config import JobConfig
    from titan_trainer.dry_run import simulate_rank

    args = [
        "--model.flavor",
        "debugmodel",
        "--training.seq_len",
        "2048",
        "--training.local_batch_size",
        "8",
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "none",
        "--job.dump_folder",
        str(tmp_path),
    ]
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    predicted = simulate_rank(load_config(JobConfig, args), 1, 0, vocab, "every rank").step.total
    result = run_cli(
        [*args, "--job.device", "cuda", "--training.steps", "3", "--metrics.log_freq", "1"]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    peaks = [
        float(line.split("mem ")[1].split(" GiB")[0])
        for line in result.stdout.splitlines()
        if "| mem " in line
    ]
    measured = max(peaks) * 2**30
    # The allocator rounds every block up and keeps a CUDA context outside its counts.
    assert abs(predicted - measured) / measured < 0.10, (predicted / 2**30, measured / 2**30)
