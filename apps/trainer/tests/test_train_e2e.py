"""End-to-end runs through the command a user types."""

from __future__ import annotations

import math

from conftest import parse_losses, run_cli


def test_debug_run_loss_falls_from_ln_vocab(debug_args, tmp_path):
    result = run_cli([*debug_args, "--training.steps", "30", "--lr_scheduler.warmup_steps", "5"])
    assert result.returncode == 0, result.stdout + result.stderr
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, 31))
    # Byte-level vocabulary (~258 real tokens): a fresh model predicts near-uniformly.
    assert abs(losses[1] - math.log(320)) < 1.0  # vocab 259 padded to 320
    # Real text is learnable quickly: the last steps are well below the first.
    assert sum(losses[s] for s in range(26, 31)) / 5 < losses[1] - 1.5
    run = tmp_path / "run"
    assert (run / "config.toml").read_text().count("[training]") == 1
    assert list((run / "tb").rglob("events.out.tfevents.*")), "no TensorBoard events written"
    line = next(ln for ln in result.stdout.splitlines() if "step   30" in ln)
    for token in ("tok/s", "TFLOP/s", "MFU", "GiB", "s/step", "grad_norm", "lr"):
        assert token in line


def test_bad_flag_fails_fast_with_the_message(debug_args):
    result = run_cli([*debug_args, "--parallelism.tensor_parallel_degre", "2"])
    assert result.returncode == 2
    assert result.stderr.startswith(
        "titan: config error: unknown key [parallelism] tensor_parallel_degre"
    )
    assert "Traceback" not in result.stderr
