"""Optimizers found by name: a third-party one by `module:attr`, titan-parallel's Ranger21 by
its entry point; Ranger21's schedule replaces [lr_scheduler]; its state resumes bitwise."""

from __future__ import annotations

import shutil

import pytest
import third_party_optim
import torch

from titan_ckpt import load_consolidated
from titan_core import ConfigError, load_config
from titan_trainer.checks import check_config
from titan_trainer.config import JobConfig
from titan_trainer.train import train


def _args(tmp_path, *extra: str) -> list[str]:
    return [
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_tflops",
        "1",
        "--metrics.log_freq",
        "1",
        *extra,
    ]


def test_trainer_uses_a_third_party_optimizer_named_in_the_config(tmp_path):
    third_party_optim.CALLS.clear()
    config = load_config(
        JobConfig,
        _args(tmp_path, "--training.steps", "3", "--optimizer.name", "third_party_optim:build"),
    )
    check_config(config, 1)
    result = train(config)
    assert third_party_optim.CALLS == [{"lr": 8e-4, "total_steps": 3, "world": 1}]
    assert result.steps_run == 3 and all(torch.isfinite(torch.tensor(result.losses)))


def test_an_unknown_optimizer_is_a_config_error_with_a_suggestion(tmp_path):
    config = load_config(JobConfig, _args(tmp_path, "--optimizer.name", "Ranger"))
    with pytest.raises(ConfigError) as e:
        check_config(config, 1)
    text = str(e.value)
    assert "[optimizer] name = 'Ranger' is not an optimizer" in text, text
    assert "built in: AdamW, Adam" in text and "did you mean Ranger21?" in text, text
    with pytest.raises(ConfigError, match="state_dtype = 'bfloat16' is not available for Adam"):
        load_config(
            JobConfig,
            _args(tmp_path, "--optimizer.name", "Adam", "--optimizer.state_dtype", "bfloat16"),
        )


def test_ranger21_schedules_its_own_learning_rate_and_resumes_bitwise(tmp_path):
    """6 steps with checkpoints at 3 and 6, then the run resumed from step 3: the same losses
    and, at step 6, bitwise the same optimizer state (both momentum buffers, the second
    moment, Lookahead's slow weights, which merge at step 5, and the step counts)."""
    args = _args(
        tmp_path,
        "--optimizer.name",
        "Ranger21",
        "--optimizer.lr",
        "1e-2",
        "--training.steps",
        "6",
        "--optimizer.ranger21.warmup_steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
    )
    whole = train(load_config(JobConfig, args))
    folder = tmp_path / "checkpoint"
    uninterrupted = tmp_path / "uninterrupted-step-6"
    shutil.move(folder / "step-6", uninterrupted)
    resumed = train(load_config(JobConfig, args))
    assert resumed.steps_run == 3
    assert resumed.losses == whole.losses[3:]  # fp32: the same numbers, bit for bit
    expected = load_consolidated(uninterrupted, prefix="optimizer.", progress=False)
    got = load_consolidated(folder / "step-6", prefix="optimizer.", progress=False)
    assert expected.keys() == got.keys()
    kinds = {k.rsplit(".", 1)[-1] for k in expected}
    assert {"exp_avg", "exp_avg_neg", "exp_avg_sq", "slow", "step"} <= kinds, kinds
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
    steps = [v for k, v in got.items() if k.endswith(".step")]
    assert steps and all(float(s) == 6 for s in steps)


def test_ranger21_schedule_replaces_the_trainers_so_warm_up_happens_once():
    from titan_parallel import Ranger21
    from titan_trainer.config import LRScheduler
    from titan_trainer.lr_schedule import build_lr_scheduler
    from titan_trainer.optimizer import current_lr

    p = torch.nn.Parameter(torch.ones(4))
    opt = Ranger21([p], lr=1e-2, total_steps=10, warmup_steps=4)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=3), 10)
    lrs = []
    for _ in range(10):
        p.grad = torch.ones(4)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == 1e-2  # [lr_scheduler] holds the peak
        lrs.append(current_lr(opt))
    # Ranger21's own: warm-up t/4, flat, warm-down from step 8 (72% of 10) to 3e-5.
    assert lrs[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert lrs[6] == 1e-2 and lrs[-1] == pytest.approx(3e-5)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1e-2)
    build_lr_scheduler(plain, LRScheduler(warmup_steps=3), 10)
    assert current_lr(plain) == pytest.approx(1e-2 / 4)  # AdamW keeps [lr_scheduler]


def test_readme_ranger21_command_trains_the_debug_model(tmp_path):
    """The README's Ranger21 command, its arguments exactly as shown, run as `python -m
    titan_trainer` (what `uv run titan-train` runs) in a scratch folder that sees the
    repository's `apps/` (so the outputs land there, not in the checkout)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from conftest import parse_losses

    trainer = Path(__file__).parents[1]
    line = next(
        ln
        for ln in (trainer / "README.md").read_text().splitlines()
        if ln.startswith("uv run titan-train") and "Ranger21" in ln
    )
    args = re.sub(r"^uv run titan-train ", "", line).split()
    (tmp_path / "apps").symlink_to(trainer.parent)
    proc = subprocess.run(
        [sys.executable, "-m", "titan_trainer", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Ranger21 schedules its own learning rate" in out
    losses = parse_losses(out)
    assert sorted(losses) == [1, 3] and all(v == v for v in losses.values()), losses
