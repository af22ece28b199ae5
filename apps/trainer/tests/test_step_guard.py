"""The training step reads nothing back to the host, and a step whose loss or gradient norm is
NaN or inf never reaches the weights: checked with the trainer's own components (debug
model, fused AdamW, the pydocs loader) in this process."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from titan_core import init_distributed, load_config, plugins, resolve
from titan_core.distributed import destroy_distributed
from titan_trainer.checks import parallel_dims_for
from titan_trainer.config import JobConfig
from titan_trainer.guards import NonFiniteStepError, StepGuard
from titan_trainer.metrics import StepTimer
from titan_trainer.optimizer import build_optimizer
from titan_trainer.parallel import build_parallel_runtime
from titan_trainer.train import build_model, cross_entropy_loss, train_step

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
        dims = parallel_dims_for(cfg, 1)
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
            loss, grad_norm = _step(trainer_parts, optimizer, guard, step)
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
