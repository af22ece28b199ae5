"""[[optimizer.param_groups]]: each optimizer (AdamW, Adam, Ranger21, Muon, a third-party one)
gets the groups' lr, weight decay, betas and eps; the LR schedule scales each group's own peak;
bad groups are config errors before training; a resume keeps the config's group values and
refuses groups the checkpoint's state cannot load into. The same grouping under FSDP and
pipeline stages is checked in test_runtime_distributed.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from titan_ckpt import load_consolidated
from titan_core import ConfigError, load_config, plugins, resolve
from titan_trainer.config import JobConfig
from titan_trainer.lr_schedule import build_lr_scheduler
from titan_trainer.optimizer import build_optimizer
from titan_trainer.preflight import group_preflight_problems
from titan_trainer.shipped import find_config_file
from titan_trainer.train import train

GROUPS = [
    "--optimizer.param_groups",
    '[{"params": "norm", "weight_decay": 0.0},'
    ' {"params": "^layers\\\\.0\\\\.", "lr": 1e-4, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6}]',
]


def _config(*extra: str) -> JobConfig:
    return _load(["--job.config_file", "debug_model", *extra])


def _load(args: list[str]) -> JobConfig:
    return load_config(JobConfig, args, find_config_file=find_config_file)


def _model(config: JobConfig) -> torch.nn.Module:
    from titan_trainer.model import model_args_for

    spec = resolve(plugins.MODELS, config.model.name)
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, 258))
    model.to_empty(device="cpu")
    return model


def _group_of(optimizer, model) -> dict[str, dict]:
    names = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert names[id(p)] not in out, names[id(p)]  # in one group only
            out[names[id(p)]] = group
    assert set(out) == set(names.values())
    return out


@pytest.mark.parametrize("name", ["AdamW", "Adam", "Ranger21", "Muon", "third_party_optim:build"])
def test_each_optimizer_takes_the_groups_values(name):
    config = _config("--optimizer.name", name, "--optimizer.lr", "3e-3", *GROUPS)
    model = _model(config)
    # The third party's build reads the world size; without a mesh (one process, no process
    # group), Ranger21 takes no pipeline group.
    dims = config.parallelism.build_parallel_dims(1) if ":" in name else None
    optimizer = build_optimizer([model], config.optimizer, total_steps=10, dims=dims)
    group = _group_of(optimizer, model)
    norm, first, default = (
        group["layers.1.ffn_norm.weight"],
        group["layers.0.attention.wq.weight"],
        group["output.weight"],
    )
    assert norm["weight_decay"] == 0.0 and norm["lr"] == 3e-3
    assert group["layers.0.attention_norm.weight"] is norm  # the first matching group wins
    assert first["lr"] == 1e-4
    assert default["lr"] == 3e-3 and default["weight_decay"] == first["weight_decay"]
    if name != "third_party_optim:build":  # SGD has no betas or eps
        assert first["betas"] == (0.8, 0.9) and first["eps"] == 1e-6
        assert default["betas"] == (0.9, 0.95) and default["eps"] == 1e-8
    assert optimizer.param_groups[0] is default  # the metric line's lr is [optimizer] lr's
    if name == "Muon":
        # Hidden matrices by Muon (in any group), the rest by AdamW.
        assert first["use_muon"] and group["layers.1.attention.wo.weight"]["use_muon"]
        assert not default["use_muon"] and not group["tok_embeddings.weight"]["use_muon"]
        assert not norm["use_muon"]


def test_the_readmes_param_groups_example_loads_and_groups_as_it_says(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (example,) = [b for b in re.findall(r"```toml\n(.*?)```", readme, re.S) if "param_groups" in b]
    path = tmp_path / "groups.toml"
    path.write_text(example)
    config = load_config(JobConfig, ["--optimizer.lr", "3e-3"], toml_path=path)
    model = _model(config)
    group = _group_of(build_optimizer([model], config.optimizer, dims=None), model)
    assert group["norm.weight"]["weight_decay"] == 0.0
    assert group["layers.0.attention.wq.weight"]["lr"] == 1e-3
    assert not group["layers.0.attention.wq.weight"]["use_muon"]
    assert group["layers.1.attention.wq.weight"]["use_muon"]
    assert group["layers.1.attention.wq.weight"]["lr"] == 3e-3


def test_muon_switch_and_muon_lr():
    config = _config(
        *("--optimizer.name", "Muon", "--optimizer.muon.lr", "0.02"),
        *("--optimizer.param_groups", '[{"params": "feed_forward", "muon": false}]'),
    )
    model = _model(config)
    group = _group_of(build_optimizer([model], config.optimizer, dims=None), model)
    assert not group["layers.0.feed_forward.w1.weight"]["use_muon"]
    assert group["layers.0.feed_forward.w1.weight"]["lr"] == config.optimizer.lr
    assert group["layers.0.attention.wk.weight"]["use_muon"]
    assert group["layers.0.attention.wk.weight"]["lr"] == 0.02  # [optimizer.muon] lr


def test_the_schedule_scales_each_groups_own_peak():
    config = _config("--lr_scheduler.warmup_steps", "3", *GROUPS)
    model = _model(config)
    optimizer = build_optimizer([model], config.optimizer, total_steps=10, dims=None)
    schedule = build_lr_scheduler(optimizer, config.lr_scheduler, 10)
    peaks = [g["lr"] for g in optimizer.param_groups]  # warm-up factor 1/4 at step 0
    assert sorted({round(p * 4, 12) for p in peaks}) == [1e-4, 3e-3]  # debug_model: lr 3e-3
    for _ in range(3):
        optimizer.step()
        schedule.step()
    factor = schedule.lr_lambdas[0](schedule.last_epoch)
    assert factor < 1  # decaying
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
        [p * 4 * factor for p in peaks]
    )


@pytest.mark.parametrize(
    "groups, expected",
    [
        ('[{"params": "norm("}]', "params = 'norm(' is not a valid regular expression"),
        ('[{"params": ""}]', "[[optimizer.param_groups]] has no params"),
        ('[{"params": "x", "lr": -1}]', "params = 'x': lr = -1.0 is not valid"),
        ('[{"params": "x", "muon": true}]', "sets muon = true, but [optimizer] name = 'AdamW'"),
    ],
)
def test_bad_groups_are_config_errors(groups, expected):
    with pytest.raises(ConfigError) as e:
        _config("--optimizer.param_groups", groups)
    assert expected in str(e.value), str(e.value)


def test_a_group_that_takes_nothing_is_refused_before_training(capsys, tmp_path):
    from titan_trainer.cli import main

    groups = '[{"params": "^norm"}, {"params": "attention_nrom"}, {"params": "^norm\\\\.w"}]'
    code = main(
        ["--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path)]
        + ["--optimizer.param_groups", groups]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "#2 params = 'attention_nrom' takes no parameter: it matches none of the" in err, err
    assert "#3 params = '^norm\\\\.w' takes no parameter: every parameter it matches" in err, err
    assert "(norm.weight, ...) is taken by an earlier group" in err, err
    assert not (tmp_path / "config.toml").exists()  # stopped before the run started


def _args(tmp_path, *extra: str) -> list[str]:
    return [
        *("--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path)),
        *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"),
        *("--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1"),
        *("--metrics.save_plots_folder", "", "--lr_scheduler.warmup_steps", "1"),
        *("--optimizer.name", "Muon", "--optimizer.muon.ns_dtype", "float32"),
        *("--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", "2"),
        *extra,
    ]


def test_muon_with_groups_resumes_bitwise_and_a_resume_keeps_the_configs_values(tmp_path, caplog):
    """2 steps with checkpoints at 1 and 2, then resumed from 1: the same losses and optimizer
    state. Resumed again with other group values: they apply, with a warning; with another
    grouping or Muon switch, the preflight refuses, naming the fix."""
    args = _args(tmp_path, *GROUPS)
    whole = train(_load(args))
    folder = tmp_path / "checkpoint"
    shutil.move(folder / "step-2", tmp_path / "uninterrupted-step-2")
    resumed = train(_load(args))
    assert resumed.steps_run == 1 and resumed.losses == whole.losses[1:]
    expected = load_consolidated(tmp_path / "uninterrupted-step-2", prefix="optimizer.")
    got = load_consolidated(folder / "step-2", prefix="optimizer.")
    assert expected.keys() == got.keys()
    assert {k.rsplit(".", 1)[-1] for k in got} >= {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key

    # Other values for the same groups: the config's apply from the resumed step on.
    changed = [
        "--optimizer.lr",
        "1.6e-3",
        "--optimizer.param_groups",
        '[{"params": "norm", "weight_decay": 0.05},'
        ' {"params": "^layers\\\\.0\\\\.", "lr": 1e-4, "beta1": 0.8, "beta2": 0.9, "eps": 1e-6}]',
    ]
    config = _load(_args(tmp_path, *changed, "--training.steps", "3"))
    assert group_preflight_problems(config, _model(config)) == []
    train(config)
    text = (tmp_path / "logs" / "rank_0.log").read_text()  # every line the runs logged
    assert "parameter-group values differ from the checkpoint's" in text, text
    # debug_model's lr is 3e-3; the norms' group is group 2 (after the default's two parts).
    assert "group 0 initial_lr 0.003 -> 0.0016" in text, text
    assert "group 2 weight_decay 0.0 -> 0.05" in text, text

    # Muon's switch or the grouping changed: the saved state does not fit; refused at start.
    switched = _load(
        _args(tmp_path, "--optimizer.param_groups", '[{"params": "attention", "muon": false}]')
    )
    problem = "\n".join(group_preflight_problems(switched, _model(switched)))
    assert "muon changed since the checkpoint this run resumes from" in problem, problem
    assert "layers.0.attention.wq.weight, layers.0.attention.wk.weight and" in problem, problem
    assert "--checkpoint.initial_load_path" in problem, problem
    merged = _load(_args(tmp_path))  # the norms back in the default group
    (problem,) = group_preflight_problems(merged, _model(merged))
    assert "group default now holds parameters" in problem, problem
    assert "that were in different groups there (#1 norm, #2 ^layers\\.0\\., default)" in problem
    renamed = _load(_args(tmp_path, "--optimizer.name", "AdamW"))
    (problem,) = group_preflight_problems(renamed, _model(renamed))
    assert "holds the state of 'Muon', which does not load into AdamW" in problem, problem
