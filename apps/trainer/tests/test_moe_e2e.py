"""Qwen3's mixture-of-experts debug config through the trainer (the README's command, which
trains it and reports the experts' load, runs in test_readme_commands.py): FSDP over 2
processes takes the steps one process takes (fp32, every sample the same document so that
sharding the data changes no batch, losses within 2e-4)."""

from __future__ import annotations

from conftest import TRAINER, parse_losses, run_cli

CONFIG = str(TRAINER / "configs" / "qwen3_moe_debug.toml")


def _args(folder, *extra: str) -> list[str]:
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(folder),
            "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
            "--training.seq_len", "128", *extra]  # fmt: skip


def test_fsdp_on_2_processes_matches_one_process(tmp_path, same_doc_dataset):
    common = ["--training.dataset", same_doc_dataset, "--training.steps", "4",
              "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
              "--metrics.enable_tensorboard", "false"]  # fmt: skip
    one = run_cli(_args(tmp_path / "one", *common, "--training.local_batch_size", "4"))
    two = run_cli(_args(tmp_path / "two", *common, "--training.local_batch_size", "2"), nproc=2)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = parse_losses(one.stdout), parse_losses(two.stdout)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) <= 2e-4, (step, a, b)


def test_layouts_that_cannot_split_experts_are_refused_before_start():
    import pytest

    from titan_core import ConfigError
    from titan_trainer.checks import check_config
    from titan_trainer.config import JobConfig

    config = JobConfig()
    config.model.name, config.model.flavor = "qwen3", "debugmodel_moe"
    config.parallelism.tensor_parallel_degree = 2
    with pytest.raises(ConfigError, match="experts cannot be split by tensor parallel yet"):
        check_config(config, 2)
    config.parallelism.tensor_parallel_degree = 1
    config.parallelism.expert_parallel_degree = 2
    with pytest.raises(ConfigError, match="expert parallel is not in Titan yet"):
        check_config(config, 2)
    config.model.flavor = "debugmodel"  # dense Qwen3: tensor parallel is fine
    config.parallelism.expert_parallel_degree = 1
    config.parallelism.tensor_parallel_degree = 2
    check_config(config, 2)
