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


def test_ranger21_state_reshards_from_fsdp2_x_tp2_to_one_process_and_to_fsdp2(
    tmp_path, same_doc_dataset
):
    """Ranger21 trained 6 steps on 4 processes (FSDP2 x TP2) with a checkpoint at step 3; that
    checkpoint resumed on 1 process and on 2 (FSDP2) continues with the 4-process losses, and
    its step-6 optimizer state (both momentum buffers, the second moment, Lookahead's slow
    weights, which merge at step 5, and the step counts) equals the 4-process one up to the
    order of fp32 sums."""
    from conftest import DEBUG_TOML, parse_losses, run_cli

    def args(folder, *extra):
        return [
            *("--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(folder)),
            *("--training.dataset", same_doc_dataset, "--training.seq_len", "128"),
            *("--training.local_batch_size", "4", "--training.global_batch_size", "8"),
            *("--training.steps", "6", "--training.mixed_precision_param", "float32"),
            *("--optimizer.name", "Ranger21", "--optimizer.lr", "1e-2"),
            *("--optimizer.ranger21.warmup_steps", "2"),
            *("--checkpoint.enable", "--checkpoint.interval", "3"),
            # Every sample is the same document: the data order cannot depend on the layout,
            # and the loader's position (kept per data-parallel rank) is not carried over.
            *("--checkpoint.exclude_from_loading", "dataloader"),
            *("--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
            *("--metrics.peak_tflops", "1", "--metrics.save_plots_folder", ""),
            *extra,
        ]

    sharded = tmp_path / "fsdp2_x_tp2"
    result = run_cli(
        args(sharded, "--parallelism.data_parallel_shard_degree", "2",
             "--parallelism.tensor_parallel_degree", "2"),
        nproc=4,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    whole = parse_losses(result.stdout)
    assert sorted(whole) == list(range(1, 7))
    expected = load_consolidated(sharded / "checkpoint" / "step-6", "optimizer.", progress=False)
    kinds = {k.rsplit(".", 1)[-1] for k in expected}
    assert {"exp_avg", "exp_avg_neg", "exp_avg_sq", "slow", "step"} <= kinds, kinds

    for name, nproc, layout in [
        ("one_process", 1, []),
        ("fsdp2", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    ]:
        folder = tmp_path / name
        (folder / "checkpoint").mkdir(parents=True)
        shutil.copytree(sharded / "checkpoint" / "step-3", folder / "checkpoint" / "step-3")
        result = run_cli(args(folder, *layout), nproc=nproc)
        assert result.returncode == 0, name + result.stdout[-3000:] + result.stderr[-3000:]
        losses = parse_losses(result.stdout)
        assert sorted(losses) == [4, 5, 6], (name, losses)
        for step, loss in losses.items():
            # The log prints 4 decimals; fp32 reduction orders differ by ~1e-6 relative.
            assert loss == pytest.approx(whole[step], abs=2e-4), (name, step)
        got = load_consolidated(folder / "checkpoint" / "step-6", "optimizer.", progress=False)
        assert got.keys() == expected.keys(), name
        for key, want in expected.items():
            if key.endswith(".step"):
                assert float(got[key]) == float(want) == 6, (name, key)
                continue
            err = float((got[key] - want).norm() / want.norm().clamp(min=1e-30))
            # Measured: at most ~1e-6 (sums in another order, then 3 more steps).
            assert err <= 1e-4, (name, key, err)


def test_the_memory_check_counts_each_optimizers_own_states():
    """The start-up memory check counts what each optimizer keeps per parameter (in float32
    parameter sizes), as the optimizers themselves allocate it."""
    from titan_parallel import AdamW, Ranger21
    from titan_trainer.config import Optimizer
    from titan_trainer.optimizer import optimizer_state_copies

    def allocated(opt, p) -> float:
        opt.step()
        return sum(v.numel() * v.element_size() for v in opt.state[p].values() if v.dim() > 0) / (
            p.numel() * p.element_size()
        )

    cases = [
        (dict(name="AdamW"), lambda p: torch.optim.AdamW([p])),
        (dict(name="AdamW", state_dtype="bfloat16"), lambda p: AdamW([p], state_dtype=torch.bfloat16)),
        (dict(name="Ranger21"), lambda p: Ranger21([p], total_steps=10)),
        (dict(name="Ranger21", state_dtype="bfloat16"),
         lambda p: Ranger21([p], total_steps=10, state_dtype=torch.bfloat16)),
    ]  # fmt: skip
    for options, make in cases:
        p = torch.nn.Parameter(torch.ones(8, 4))
        p.grad = torch.ones(8, 4)
        assert optimizer_state_copies(Optimizer(**options)) == allocated(make(p), p), options
    ranger = Optimizer(name="Ranger21")
    ranger.ranger21.core, ranger.ranger21.lookahead = "madgrad", False
    p = torch.nn.Parameter(torch.ones(8, 4))
    p.grad = torch.ones(8, 4)
    opt = Ranger21([p], total_steps=10, core="madgrad", lookahead=False)
    assert optimizer_state_copies(ranger) == allocated(opt, p) == 3


def test_the_memory_check_asks_a_third_party_optimizer_for_its_state():
    """An optimizer plugin reports the state it keeps per parameter (`state_copies`): the
    memory and disk checks count SGD with momentum's one buffer, not Adam's two."""
    from titan_trainer.config import Optimizer
    from titan_trainer.optimizer import optimizer_state_copies

    sgd = Optimizer(name="third_party_optim:build", beta1=0.9)
    p = torch.nn.Parameter(torch.ones(8, 4))
    p.grad = torch.ones(8, 4)
    opt = third_party_optim.build([p], sgd, total_steps=1, dims=_OneProcess())
    opt.step()
    kept = sum(v.numel() for v in opt.state[p].values() if v.dim() > 0) / p.numel()
    assert optimizer_state_copies(sgd) == kept == 1


class _OneProcess:
    world_size = 1
