"""Exact resume through the trainer: a run resumed from its step-N checkpoint repeats the
uninterrupted run's steps N+1..2N exactly."""

from __future__ import annotations

import shutil

from conftest import parse_losses, run_cli


def test_resume_from_a_checkpoint_matches_uninterrupted_run_bitwise(debug_args, tmp_path):
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
        "--metrics.peak_tflops",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
    ]
    whole = run_cli(args)
    assert whole.returncode == 0, whole.stderr
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) == [
        "step-3",
        "step-6",
    ]
    # Forget everything after step 3, as if the job had died there, and start it again: the
    # same command resumes from step 3 on its own (model, optimizer, LR schedule, data
    # position and RNG all come from the checkpoint).
    shutil.rmtree(folder / "step-6")
    again = run_cli(args)
    assert again.returncode == 0, again.stderr
    assert "resumed at step 3" in again.stdout
    expected = parse_losses(whole.stdout)
    resumed = parse_losses(again.stdout)
    assert sorted(resumed) == [4, 5, 6]
    assert {
        s: expected[s] for s in (4, 5, 6)
    } == resumed  # fp32, same numbers to the last printed digit
