"""torchtitan's last release with TOML configs (v0.2.2, 20 February 2026; it moved to Python
configs three days later), file by file. `torchtitan_configs/` holds one TOML of Titan's own per
torchtitan file, with the sections, keys and value forms that file uses (together: every key
any of them sets, checked below), each naming the world size it is written for. Each goes
through the dry run's checks at that size, in one process; the outcome per file is asserted:
it passes them, or it is refused by name for the reason written next to it. `nox -s
dryrun-torchtitan` simulates the ones that pass (the trainer's docs list the results).
"""

from __future__ import annotations

import logging
import re
import shlex
from pathlib import Path

import pytest

from titan_core import ConfigError, load_config
from titan_trainer.config import JobConfig
from titan_trainer.preflight import preflight_problems

FOLDER = Path(__file__).parent / "torchtitan_configs"

# File -> None (the dry run's checks pass) or the refusal, with why it is right.
OUTCOMES: dict[str, str | None] = {
    "llama3_debug_model": None,
    "integration_base_config": None,
    "llama3_8b": None,
    "llama3_70b": None,
    "llama3_405b": None,  # converters = ["float8"]: torchtitan's older name, read as Float8
    "llama3_ft_debug_model": None,  # streaming DiLoCo's fragment keys are named as ignored
    "llama4_debug_model": None,
    "llama4_17bx16e": None,
    # torch's 1F1B schedule needs a microbatch per stage; local batch 1 gives one for 4 stages.
    "llama4_17bx128e": "1F1B needs at least as many microbatches as stages: 1 < 4",
    "qwen3_0.6b": None,
    "qwen3_1.7b": None,
    "qwen3_32b": None,
    "qwen3_moe_debug": None,
    "deepseek_v3_debug_model": None,
    "deepseek_v3_16b": None,
    "deepseek_v3_671b": None,  # passes the checks; without expert parallel it does not fit
    "gpt_oss_debug_model": None,
    # Model families Titan does not have: Flux (a diffusion model for images), a
    # vision-language model, and models run through Hugging Face transformers' own code.
    "flux_debug_model": "unknown section [encoder]",
    "flux_dev_model": "unknown section [encoder]",
    "flux_schnell_model": "unknown section [encoder]",
    "vlm_debug_model": "unknown section [data]",
    "transformers_backend_debug_model": "unknown section [hf_transformers]",
    "transformers_backend_full": "unknown section [hf_transformers]",
}

# Every key torchtitan v0.2.2's TOML files set (read from them, key names only).
TORCHTITAN_KEYS = [
    "activation_checkpoint.mode",
    "activation_checkpoint.selective_ac_option",
    "checkpoint.async_mode",
    "checkpoint.enable",
    "checkpoint.export_dtype",
    "checkpoint.folder",
    "checkpoint.interval",
    "checkpoint.last_save_model_only",
    "comm.train_timeout_seconds",
    "compile.components",
    "compile.enable",
    "data.max_images_per_batch",
    "data.max_patches_per_image",
    "encoder.autoencoder_path",
    "encoder.clip_encoder",
    "encoder.max_t5_encoding_len",
    "encoder.t5_encoder",
    "fault_tolerance.enable",
    "fault_tolerance.num_fragments",
    "fault_tolerance.process_group",
    "fault_tolerance.process_group_timeout_ms",
    "fault_tolerance.semi_sync_method",
    "fault_tolerance.sync_steps",
    "hf_transformers.model",
    "inference.local_batch_size",
    "inference.prompts_path",
    "inference.save_img_folder",
    "job.custom_config_module",
    "job.description",
    "job.dump_folder",
    "job.print_config",
    "lr_scheduler.decay_ratio",
    "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor",
    "lr_scheduler.warmup_steps",
    "metrics.disable_color_printing",
    "metrics.enable_tensorboard",
    "metrics.enable_wandb",
    "metrics.log_freq",
    "metrics.save_tb_folder",
    "model.converters",
    "model.flavor",
    "model.hf_assets_path",
    "model.name",
    "optimizer.eps",
    "optimizer.lr",
    "optimizer.name",
    "parallelism.context_parallel_degree",
    "parallelism.data_parallel_replicate_degree",
    "parallelism.data_parallel_shard_degree",
    "parallelism.enable_async_tensor_parallel",
    "parallelism.expert_parallel_degree",
    "parallelism.expert_tensor_parallel_degree",
    "parallelism.fsdp_reshard_after_forward",
    "parallelism.pipeline_parallel_degree",
    "parallelism.pipeline_parallel_schedule",
    "parallelism.tensor_parallel_degree",
    "profiling.enable_memory_snapshot",
    "profiling.enable_profiling",
    "profiling.profile_freq",
    "profiling.profiler_active",
    "profiling.profiler_warmup",
    "profiling.save_memory_snapshot_folder",
    "profiling.save_traces_folder",
    "quantize.grouped_mm.float8.fqns",
    "quantize.grouped_mm.mx.fqns",
    "quantize.linear.float8.enable_fsdp_float8_all_gather",
    "quantize.linear.float8.filter_fqns",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
    "quantize.linear.mx.filter_fqns",
    "training.classifier_free_guidance_prob",
    "training.dataset",
    "training.dataset_path",
    "training.img_size",
    "training.local_batch_size",
    "training.max_norm",
    "training.seq_len",
    "training.steps",
    "validation.all_timesteps",
    "validation.classifier_free_guidance_scale",
    "validation.dataset",
    "validation.denoising_steps",
    "validation.enable",
    "validation.enable_classifier_free_guidance",
    "validation.freq",
    "validation.local_batch_size",
    "validation.save_img_count",
    "validation.save_img_folder",
    "validation.steps",
]


def dry_run_args(path: Path) -> list[str]:
    """The `--dry_run.*` flags a file's `# titan dry run:` line gives (its world size)."""
    (line,) = [x for x in path.read_text().splitlines() if x.startswith("# titan dry run:")]
    return shlex.split(line.removeprefix("# titan dry run:"))


def world_size(path: Path) -> int:
    args = dry_run_args(path)
    return int(args[args.index("--dry_run.world_size") + 1])


def test_there_is_one_file_per_torchtitan_toml_and_together_they_set_every_key():
    import tomllib

    assert {p.stem for p in FOLDER.glob("*.toml")} == set(OUTCOMES)
    keys = set()

    def walk(prefix: str, table: dict) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                keys.add(prefix + key)

    for path in FOLDER.glob("*.toml"):
        walk("", tomllib.loads(path.read_text()))
    assert keys == set(TORCHTITAN_KEYS)


def test_each_torchtitan_style_toml_passes_the_dry_run_checks_or_is_refused_by_name(
    torchtitan_checkout, caplog
):
    outcomes = {}
    tokenizer_files = 0
    for path in sorted(FOLDER.glob("*.toml")):
        try:
            config = load_config(JobConfig, ["--job.config_file", str(path)])
        except ConfigError as e:
            outcomes[path.stem] = str(e)
            continue
        problems, notes, vocab_size = preflight_problems(config, world_size(path), dry_run=True)
        outcomes[path.stem] = "\n".join(problems) or None
        if config.model.hf_assets_path == "./tests/assets/tokenizer" and not problems:
            # torchtitan's test tokenizer folder: its tokenizer.json is loaded and sizes the
            # vocabulary (1,000 BPE ids and 3 special tokens), not the flavor's default.
            assert not [n for n in notes if "cannot be loaded" in n], (path.stem, notes)
            assert vocab_size == 1003, (path.stem, vocab_size)
            tokenizer_files += 1
        if path.stem in (
            "llama3_debug_model",
            "llama4_debug_model",
            "qwen3_moe_debug",
            "gpt_oss_debug_model",
        ):
            # c4_test is the folder torchtitan reads it from, relative to where it runs.
            assert "[training] dataset: c4_test: 1 jsonl file (tests/assets/c4_test)" in notes
    assert tokenizer_files >= 5  # the debug configs that read torchtitan's test tokenizer
    for name, expected in OUTCOMES.items():
        if expected is None:
            assert outcomes[name] is None, (name, outcomes[name])
        else:
            assert outcomes[name] is not None and expected in outcomes[name], (name, outcomes[name])


def test_each_torchtitan_toml_dry_runs_as_given_at_a_world_size_that_is_said(monkeypatch):
    # Every file sets data_parallel_shard_degree = -1, which leaves the world size open: the
    # dry run takes one node of 8 (torchtitan's launcher's NGPU), rounded up to a multiple of
    # the other degrees, and says so, instead of stopping after seconds of imports.
    from titan_trainer.dry_run import resolve_world_size  # noqa: PLC0415

    monkeypatch.delenv("NGPU", raising=False)
    checked = 0
    for path in sorted(FOLDER.glob("*.toml")):
        if OUTCOMES[path.stem] is not None and "unknown section" in OUTCOMES[path.stem]:
            continue
        config = load_config(JobConfig, ["--job.config_file", str(path)])
        assert config.parallelism.data_parallel_shard_degree == -1, path.stem
        size, note = resolve_world_size(config)
        p = config.parallelism
        fixed = (
            p.data_parallel_replicate_degree
            * p.context_parallel_degree
            * p.tensor_parallel_degree
            * p.pipeline_parallel_degree
        )
        assert size >= 8 and size % fixed == 0 and size - fixed < 8, (path.stem, size, fixed)
        assert note.startswith(f"world size {size}: data_parallel_shard_degree = -1 takes")
        assert "--dry_run.world_size N (or NGPU=N) simulates another" in note
        config.parallelism.build_parallel_dims(size)  # a layout the degrees accept
        checked += 1
    assert checked == 17


def test_torchtitan_older_names_are_read_with_a_one_line_notice(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="titan"):
        config = load_config(JobConfig, ["--job.config_file", str(FOLDER / "llama3_405b.toml")])
    assert config.model.converters == ["quantize.linear.float8"]
    float8 = config.quantize.linear.float8
    assert float8.auto_filter_small_kn and float8.filter_fqns == ["output"]
    said = [r.getMessage() for r in caplog.records]
    assert any(
        re.fullmatch(r'\[model\] converters = "float8" \(from llama3_405b.toml\) is an older'
                     r' name; read as "quantize.linear.float8"', m)
        for m in said
    ), said  # fmt: skip
    assert any("auto_filter_small_kn\" is torchtitan's switch" in m for m in said), said
    # The command line's list form too.
    config = load_config(JobConfig, ["--model.converters", "float8"])
    assert config.model.converters == ["quantize.linear.float8"]


@pytest.mark.slow  # a minute and a half of simulation on a 2-core CPU: `nox -s slow`
def test_the_docs_state_the_deepseek_v3_16b_verdict_the_dry_run_gives(tmp_path, monkeypatch):
    # The docs' table (docs/torchtitan_configs.md) said it did not fit, from a simulation
    # before compiled code was simulated as inductor runs it; the dry run as given today says.
    import subprocess
    import sys

    monkeypatch.delenv("NGPU", raising=False)
    done = subprocess.run(
        [sys.executable, "-m", "titan_trainer", "--job.config_file",
         str(FOLDER / "deepseek_v3_16b.toml"), "--dry-run", "--job.dump_folder", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    peak = re.search(
        r"verdict: fits, ([\d.]+) GiB free on the fullest rank \(peak ([\d.]+)", done.stdout
    )
    assert peak, done.stdout
    doc = (FOLDER.parents[1] / "docs" / "torchtitan_configs.md").read_text()
    (row,) = [x for x in doc.splitlines() if "deepseek_v3/train_configs/deepseek_v3_16b.toml" in x]
    assert f"fits: peak {peak[2]} GiB" in row and f"{peak[1]} GiB free" in row, (row, peak[0])
