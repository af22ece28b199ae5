"""The training step reads nothing back to the host, and a step whose loss or gradient norm is
NaN or inf never reaches the weights: checked with the trainer's own components (debug
model, fused AdamW, the pydocs loader) in this process."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from titan_core import init_distributed, load_config, plugins, resolve
from titan_core.distributed import destroy_distributed
from titan_trainer.config import JobConfig
from titan_trainer.guards import NonFiniteStepError, StepGuard
from titan_trainer.loss import cross_entropy_loss
from titan_trainer.metrics import StepTimer
from titan_trainer.model import build_model
from titan_trainer.optimizer import build_optimizer
from titan_trainer.runtime import build_parallel_runtime
from titan_trainer.train import train_step

READBACKS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}


class Readbacks(TorchFunctionMode):
    """Records every tensor method that copies a value to the host: on a GPU each one waits
    for the device to finish its queue (on this CPU they are what would)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READBACKS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def trainer_parts():
    cfg = load_config(
        JobConfig,
        [
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.mixed_precision_param",
            "float32",
            "--activation_checkpoint.mode",
            "none",
        ],
    )
    info = init_distributed("cpu")
    try:
        dims = cfg.parallelism.build_parallel_dims(1)
        dims.build_mesh("cpu")
        data = resolve(plugins.DATA, cfg.training.data_plugin)
        tokenizer = data.build_tokenizer("byte")
        loader = data.build_dataloader(
            dataset="pydocs", dataset_path=None, tokenizer=tokenizer, seq_len=64, batch_size=2
        )
        runtime = build_parallel_runtime(
            cfg, dims, info.device, torch.float32, 0, cross_entropy_loss
        )
        parts = build_model(cfg, runtime, tokenizer.vocab_size, [])
        runtime.materialize(parts)
        runtime.init_weights(parts)
        yield cfg, runtime, parts, iter(loader)
    finally:
        destroy_distributed()


def _step(trainer_parts, optimizer, guard, step):
    cfg, runtime, parts, batches = trainer_parts
    return train_step(runtime, parts, optimizer, batches, 1, StepTimer(), cfg, guard, step)


def test_training_steps_read_nothing_back_and_a_logging_step_reads_once(trainer_parts):
    cfg, _, parts, _ = trainer_parts
    optimizer = build_optimizer(parts, cfg.optimizer)
    guard = StepGuard(optimizer)
    assert guard.on_device  # the default fused AdamW skips a bad step on the device
    _step(trainer_parts, optimizer, guard, 1)  # the first step creates the optimizer's state
    with Readbacks() as seen:
        for step in (2, 3, 4):
            loss, grad_norm, _ = _step(trainer_parts, optimizer, guard, step)
    assert seen.calls == [], f"host read-backs inside training steps: {seen.calls}"
    assert isinstance(loss, torch.Tensor) and isinstance(grad_norm, torch.Tensor)
    with Readbacks() as seen:
        rows = guard.read()
    assert seen.calls == ["tolist"]  # every step's loss and norm, and the verdict, in one go
    assert [row[0] for row in rows] == [1, 2, 3, 4]
    assert all(0 < loss < 10 and grad_norm > 0 for _, loss, grad_norm in rows)
    assert guard.read() == []


def _snapshot(parts, optimizer):
    params = [p.detach().clone() for part in parts for p in part.parameters()]
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    return params, moments


def test_a_nan_step_is_skipped_on_the_device_and_reported_at_the_next_read(trainer_parts):
    cfg, runtime, parts, batches = trainer_parts
    optimizer = build_optimizer(parts, cfg.optimizer)
    guard = StepGuard(optimizer)
    _step(trainer_parts, optimizer, guard, 1)
    guard.read()
    before = _snapshot(parts, optimizer)
    # Step 2 as train_step runs it, with a loss that came out NaN (the gradients are real).
    optimizer.zero_grad(set_to_none=True)
    inputs, labels = next(batches)
    runtime.forward_backward(parts, inputs, labels, scale=1.0)
    grad_norm = runtime.clip_grad_norm(parts, cfg.training.max_norm)
    guard.before_step(2, torch.tensor(float("nan")), grad_norm)
    optimizer.step()
    after = _snapshot(parts, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "weights changed"
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])), "Adam moments changed"
    _step(trainer_parts, optimizer, guard, 3)  # a good step after it is applied...
    assert not all(torch.equal(a, b) for a, b in zip(after[0], _snapshot(parts, optimizer)[0]))
    with pytest.raises(NonFiniteStepError) as info:  # ...and the run learns at the next read
        guard.read()
    message = str(info.value)
    assert message.startswith("step 2: loss nan and grad_norm ")
    assert "that update was not applied" in message and "Lower [optimizer] lr" in message
    assert "the weights hold finite values (checked now)" in message


def test_the_stop_message_says_so_when_an_earlier_update_made_the_weights_non_finite(
    trainer_parts,
):
    # What `--optimizer.lr inf` does: the first update is applied (its loss and gradient norm
    # are finite) and leaves inf in the weights; the next step's loss is NaN.
    cfg, _, parts, _ = trainer_parts
    optimizer = build_optimizer(parts, cfg.optimizer)
    guard = StepGuard(optimizer)
    weight = next(iter(parts[0].parameters()))
    kept = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.view(-1)[0] = float("inf")
        _bad_step(trainer_parts, optimizer, guard, 2)
        with pytest.raises(NonFiniteStepError) as info:
            guard.read()
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    message = str(info.value)
    assert "that update was not applied, but the weights already hold NaN or inf" in message
    assert "finite values" not in message, message  # no claim that was not checked


def test_an_optimizer_that_cannot_skip_is_checked_on_the_host_before_its_step(trainer_parts):
    cfg, runtime, parts, batches = trainer_parts
    cfg.optimizer.implementation = "foreach"
    try:
        optimizer = build_optimizer(parts, cfg.optimizer)
    finally:
        cfg.optimizer.implementation = "fused"
    guard = StepGuard(optimizer)
    assert not guard.on_device
    with pytest.raises(NonFiniteStepError, match=r"^step 7: loss inf and grad_norm 1\.0"):
        guard.before_step(7, torch.tensor(float("inf")), torch.tensor(1.0))


def _bad_step(trainer_parts, optimizer, guard, step) -> bool:
    """Step `step` as train_step runs it, with a loss that came out NaN; returns whether the
    guard let the optimizer step."""
    cfg, runtime, parts, batches = trainer_parts
    optimizer.zero_grad(set_to_none=True)
    inputs, labels = next(batches)
    runtime.forward_backward(parts, inputs, labels, scale=1.0)
    grad_norm = runtime.clip_grad_norm(parts, cfg.training.max_norm)
    go = guard.before_step(step, torch.tensor(float("nan")), grad_norm)
    if go:
        optimizer.step()
    return go


def test_up_to_n_bad_steps_in_a_row_are_skipped_and_counted_on_the_device(trainer_parts, caplog):
    cfg, _, parts, _ = trainer_parts
    optimizer = build_optimizer(parts, cfg.optimizer)
    guard = StepGuard(optimizer, max_in_a_row=2)
    _step(trainer_parts, optimizer, guard, 1)
    before = _snapshot(parts, optimizer)
    assert _bad_step(trainer_parts, optimizer, guard, 2) and _bad_step(
        trainer_parts, optimizer, guard, 3
    )
    assert all(torch.equal(a, b) for a, b in zip(before[0], _snapshot(parts, optimizer)[0]))
    _step(trainer_parts, optimizer, guard, 4)  # the streak ends: the run goes on
    with caplog.at_level("WARNING", logger="titan"):
        rows = guard.read()
    assert [r[0] for r in rows] == [1, 2, 3, 4] and guard.skipped == 2
    assert "step 3: loss nan" in caplog.text and "update skipped (2 skipped" in caplog.text
    for step in (5, 6, 7):  # three in a row: one more than allowed
        _bad_step(trainer_parts, optimizer, guard, step)
    with pytest.raises(NonFiniteStepError) as info:
        guard.read()
    assert str(info.value).startswith("step 7: loss nan")
    assert "3 non-finite steps in a row, more than [training] max_nonfinite_in_a_row = 2" in str(
        info.value
    )
    assert guard.skipped == 5


def test_an_optimizer_checked_on_the_host_skips_its_step_and_stops_after_n(trainer_parts):
    cfg, _, parts, _ = trainer_parts
    cfg.optimizer.implementation = "foreach"
    try:
        optimizer = build_optimizer(parts, cfg.optimizer)
    finally:
        cfg.optimizer.implementation = "fused"
    guard = StepGuard(optimizer, max_in_a_row=1)
    _step(trainer_parts, optimizer, guard, 1)
    before = _snapshot(parts, optimizer)
    assert not _bad_step(trainer_parts, optimizer, guard, 2)  # skipped: no optimizer step
    assert all(torch.equal(a, b) for a, b in zip(before[0], _snapshot(parts, optimizer)[0]))
    assert guard.skipped == 1
    _step(trainer_parts, optimizer, guard, 3)
    assert not _bad_step(trainer_parts, optimizer, guard, 4)  # a new streak of one
    with pytest.raises(NonFiniteStepError, match="2 non-finite steps in a row"):
        _bad_step(trainer_parts, optimizer, guard, 5)
    assert [r[0] for r in guard.read()] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "optimizer",
    [["--optimizer.name", "AdamW"], ["--optimizer.name", "AdamW", "--optimizer.implementation",
                                     "foreach"]],
    ids=["fused_skips_on_the_device", "foreach_skips_on_the_host"],
)  # fmt: skip
def test_nan_gradients_on_one_rank_are_skipped_then_stop_the_run_with_finite_checkpoints(
    tmp_path, optimizer
):
    """2 processes (FSDP2); rank 1's output, and so its gradients, turn NaN at steps 3 and 4,
    then at 6, 7 and 8. With max_nonfinite_in_a_row = 2 the first two are skipped and counted
    and training goes on; the third in a row stops the run at step 8 with the step and the
    fix. Every checkpoint written (skipped steps included) holds finite values."""
    import os
    import sys
    from pathlib import Path

    from conftest import DEBUG_TOML, parse_losses, run_cli

    from titan_ckpt import nonfinite_tensors

    tests = str(Path(__file__).parent)

    def run(folder, steps: str):
        args = [
            *("--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(folder)),
            *("--model.name", "nan_model:spec", "--training.seq_len", "64"),
            *("--training.local_batch_size", "2", "--training.steps", "8"),
            *("--training.mixed_precision_param", "float32"),
            *("--training.max_nonfinite_in_a_row", "2"),
            *("--parallelism.data_parallel_shard_degree", "2"),
            *("--checkpoint.enable", "--checkpoint.interval", "1"),
            *("--checkpoint.keep_latest_k", "0"),
            *("--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
            *("--metrics.save_plots_folder", ""),
            *optimizer,
        ]
        env = {"TITAN_TEST_NAN_STEPS": steps, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
        return run_cli(args, nproc=2, env_extra=env)

    result = run(tmp_path / "nan", "3,4,6,7,8")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "step 8: loss nan" in out and "3 non-finite steps in a row" in out, out[-3000:]
    assert "max_nonfinite_in_a_row = 2" in out and "resume from the last checkpoint" in out
    assert "Rank 1's own loss was not finite first, at step 3" in out, out[-3000:]
    assert "update skipped" in out and "skipped steps 2" in out
    losses = parse_losses(result.stdout)
    assert all(losses[s] == losses[s] for s in (1, 2, 5))  # finite where nothing was poisoned
    saved = sorted(p.name for p in (tmp_path / "nan" / "checkpoint").glob("step-*"))
    assert "step-7" in saved and "step-8" not in saved, saved
    for step in saved:
        bad = nonfinite_tensors(tmp_path / "nan" / "checkpoint" / step, progress=False)
        assert bad == [], (step, bad)
