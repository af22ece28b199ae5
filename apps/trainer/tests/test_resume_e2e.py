"""Exact resume through the trainer: a run resumed from its step-N checkpoint repeats the
uninterrupted run's steps N+1..2N exactly, from an async save made in the process group a
CUDA job builds."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from conftest import parse_losses

from titan_ckpt import load_consolidated


def _rng_states(checkpoint) -> dict:
    """Every RNG state a checkpoint holds (Python, torch CPU, CUDA), per rank."""
    blobs = load_consolidated(checkpoint, prefix="rng.", progress=False)
    return {
        rank: torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        for rank, blob in blobs.items()
    }


# The trainer in a CUDA job's process group, with gloo in NCCL's place (see the script).
GPU_SHAPED = [sys.executable, str(Path(__file__).parent / "gpu_shaped_group.py")]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*GPU_SHAPED, *args], capture_output=True, text=True, timeout=600)


def test_resume_from_an_async_checkpoint_matches_uninterrupted_run_bitwise(debug_args, tmp_path):
    """The step-3 checkpoint is saved asynchronously, in the process group a CUDA job builds
    (gloo playing NCCL): a group without a CPU backend, as the trainer built it for CUDA
    before (NCCL alone), fails that save ("A CPU backend must be enabled for async save")."""
    args = [
        *debug_args,
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "6",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        # No metrics.peak_tflops: the start-up peak measurement runs after the checkpoint is
        # loaded, so it must leave the RNG as it found it.
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.async_mode",
        "async",
    ]
    whole = _run(args)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "process group: cuda:nccl,cpu:gloo on CUDA, cuda:gloo,cpu:gloo here" in whole.stdout
    assert "checkpoint step 3 committed (async)" in whole.stdout
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == [
        "step-3",
        "step-6",
    ]
    # Forget everything after step 3, as if the job had died there, and start it again: the
    # same command resumes from step 3 on its own (model, optimizer, LR schedule, data
    # position and RNG all come from the checkpoint).
    uninterrupted = tmp_path / "uninterrupted-step-6"
    shutil.move(folder / "step-6", uninterrupted)
    again = _run(args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed at step 3" in again.stdout
    expected = parse_losses(whole.stdout)
    resumed = parse_losses(again.stdout)
    assert sorted(resumed) == [4, 5, 6]
    assert {
        s: expected[s] for s in (4, 5, 6)
    } == resumed  # fp32, same numbers to the last printed digit
    # A model with dropout would draw from the RNG: the resumed run's generators must end where
    # the uninterrupted run's did, bit for bit.
    expected_rng, resumed_rng = _rng_states(uninterrupted), _rng_states(folder / "step-6")
    assert expected_rng.keys() == resumed_rng.keys() == {"rank0"}
    for rank, state in expected_rng.items():
        assert state.keys() == resumed_rng[rank].keys()
        for key, value in state.items():
            same = (
                torch.equal(value, resumed_rng[rank][key])
                if isinstance(value, torch.Tensor)
                else value == resumed_rng[rank][key]
            )
            assert same, f"{rank} RNG state {key!r} differs after resume"
