"""Resume through the trainer: a run resumed from its step-N checkpoint repeats the
uninterrupted run's steps N+1..2N exactly, from an async save made in the process group a
CUDA job builds; a run resumed with a longer schedule runs every step at the new schedule's
learning rate."""

from __future__ import annotations

import io
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import parse_losses
from torch.optim.optimizer import register_optimizer_step_pre_hook

from titan_ckpt import load_consolidated
from titan_trainer.cli import main as titan_train
from titan_trainer.plots import read_scalars


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


def _cosine_lr(step: int, steps: int, *, peak=3e-3, warmup=2, min_factor=0.1) -> float:
    """The debug config's schedule written out (linear warm-up over 2 steps, then cosine decay
    to 0.1 x peak over the rest): the lr of 1-based `step` in a run of `steps` steps."""
    s = step - 1
    if s < warmup:
        return peak * (s + 1) / (warmup + 1)
    p = (s - warmup + 1) / (steps - warmup)
    return peak * (min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * p)))


def _from_state_dict_init() -> bool:
    """Whether this optimizer step is torch's DCP `_init_optim_state`, which steps once at lr 0
    to create the optimizer state before a checkpoint is loaded into it (not a training step)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_init_optim_state":
            return True
        frame = frame.f_back
    return False


def _probed_run(args: list[str], capsys) -> tuple[str, list[float]]:
    """`titan-train ARGS` in this process (its output, and the lr each optimizer step ran at,
    read from the optimizer just before the step)."""
    lrs: list[float] = []

    def record(optimizer, *_) -> None:
        if not _from_state_dict_init():
            lrs.append(float(optimizer.param_groups[0]["lr"]))

    handle = register_optimizer_step_pre_hook(record)
    try:
        code = titan_train(args)
    finally:
        handle.remove()
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    return out.out + out.err, lrs


def _printed_lrs(stdout: str) -> dict[int, str]:
    return {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r"step +(\d+) \| loss .*? \| lr (\S+) \|", stdout)
    }


def test_a_longer_schedule_applies_from_the_first_resumed_step_and_lines_show_the_lr_used(
    debug_args, tmp_path, capsys
):
    """6 steps with checkpoints at 2, 4, 6; step-6 deleted; resumed with 8 steps. Every step
    runs at the lr of the schedule in force (read from the optimizer just before it steps),
    and the metric line and TensorBoard show the lr the step ran at, not the next one's."""
    args = [
        *debug_args,
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.peak_tflops",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    first, first_lrs = _probed_run(
        [*args, "--training.steps", "6", "--metrics.enable_tensorboard", "false"], capsys
    )
    expected = [_cosine_lr(s, 6) for s in range(1, 7)]
    assert first_lrs == pytest.approx(expected, rel=1e-12)  # float64 arithmetic either way
    assert _printed_lrs(first) == {s: f"{lr:.1e}" for s, lr in enumerate(expected, 1)}

    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-6")
    again, resumed_lrs = _probed_run([*args, "--training.steps", "8"], capsys)
    assert "resumed at step 4" in again
    expected = {s: _cosine_lr(s, 8) for s in range(5, 9)}
    # The old schedule's step 5 (factor 0.2319) is what the first resumed step used to run at.
    assert _cosine_lr(5, 6) / 3e-3 == pytest.approx(0.2319, abs=1e-4)
    assert resumed_lrs == pytest.approx(list(expected.values()), rel=1e-12)
    assert "from step 5 on: lr 0.0006954 there under the old schedule" in again
    assert "0.00165 under the new one (factor 0.55)" in again
    assert _printed_lrs(again) == {s: f"{lr:.1e}" for s, lr in expected.items()}
    scalars = read_scalars(str(tmp_path / "run" / "tb"))["lr"]
    assert scalars == pytest.approx(expected, rel=1e-6)  # TensorBoard stores float32
