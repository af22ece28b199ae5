"""GPT-OSS through the trainer the way users start it: Titan's debug config trains on the
embedded corpus with its loss falling (a checkpoint exported to Hugging Face format on the way,
which transformers loads), torchtitan's own gpt_oss debug TOML runs as written (shortened to a
few steps) in a directory laid out as a torchtitan checkout, and context parallel is refused
before start with the reason. (FSDP, TP, EP and PP against one process: the trainer's runtime
in test_moe_families_distributed.py.)"""

from __future__ import annotations

import json

import pytest
from conftest import TRAINER, parse_losses, run_cli

CONFIG = str(TRAINER / "configs" / "gpt_oss_debug.toml")
TORCHTITAN_TOML = TRAINER / "tests" / "torchtitan_configs" / "gpt_oss_debug_model.toml"


def test_the_debug_config_trains_and_exports_for_transformers(tmp_path):
    steps = 6
    result = run_cli(
        ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path),
         "--training.steps", str(steps), "--training.local_batch_size", "4",
         "--training.seq_len", "128",
         "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
         "--metrics.enable_tensorboard", "false",
         "--checkpoint.enable", "--checkpoint.interval", str(steps),
         "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32",
         # Hugging Face's GPT-OSS has no place for the debug flavor's router center.
         "--model.moe_router_centering", "false"],
        timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = parse_losses(result.stdout + result.stderr)
    assert len(losses) == steps, losses
    assert losses[steps] < losses[1] - 1.0, losses  # 6.4 -> about 3.2 by step 5 at batch 8 x 256
    assert "gpt_oss debugmodel" in result.stdout + result.stderr
    transformers = pytest.importorskip("transformers")
    exported = next((tmp_path / "checkpoint").glob(f"step-{steps}/hf"))
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"], config
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == "GptOssForCausalLM"


def test_torchtitans_gpt_oss_debug_toml_runs(torchtitan_checkout):
    # Run from a directory laid out as a torchtitan checkout (its test tokenizer and c4_test).
    result = run_cli(
        ["--job.config_file", str(TORCHTITAN_TOML), "--training.steps", "3",
         "--training.seq_len", "256", "--training.local_batch_size", "2"],
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = parse_losses(result.stdout + result.stderr)
    assert sorted(losses) == [1, 2, 3], losses
    assert "gpt_oss debugmodel on c4_test" in result.stdout + result.stderr


def test_context_parallel_is_refused_before_start():
    from titan_trainer.config import JobConfig
    from titan_trainer.preflight import preflight_problems

    config = JobConfig()
    config.model.name, config.model.flavor = "gpt_oss", "debugmodel"
    config.parallelism.context_parallel_degree = 2
    problems, _, _ = preflight_problems(config, 2)
    assert any(
        "context_parallel_degree = 2: GptOssTransformer's sliding-window and sink attention"
        " does not run under context parallel yet" in p
        for p in problems
    ), problems
