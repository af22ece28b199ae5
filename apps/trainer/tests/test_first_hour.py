"""What a new user meets in the first hour (issue 33, and the seq_len part of issue 28's
non-finite settings): config errors the dry run found only inside its simulation, a memory
check that counted neither the activations nor the other ranks on the host, hints that named a
command that fails, torchtitan's spellings, the dry run's wording and suggestions, and the
restart notice under fault tolerance. In-process and cheap, except the issue's exact dry-run
command and one plain start, run as typed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core import load_config, plugins, resolve
from titan_trainer.config import WANDB_MISSING, JobConfig, Model
from titan_trainer.memory_check import (
    RankNeed,
    activation_bytes,
    free_bytes,
    memory_problem,
    rank_need,
)
from titan_trainer.model import model_args_for
from titan_trainer.preflight import preflight_problems

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "apps/trainer/configs"
GiB = 2**30


def config(*args: str, toml: str = "debug_model") -> JobConfig:
    return load_config(JobConfig, ["--job.config_file", str(CONFIGS / f"{toml}.toml"), *args])


# ----------------------------------------------------------------------------- config errors


def test_the_tensor_parallel_plan_is_checked_with_the_other_config_checks():
    # The issue's command: TP 16 on the debug model (8 key/value heads), with another problem
    # beside it; both come back together, before anything is simulated.
    cfg = config("--parallelism.tensor_parallel_degree", "16", "--training.seq_len", "250")
    problems, _, _ = preflight_problems(cfg, 16, dry_run=True)
    text = "\n".join(problems)
    assert "llama3 debugmodel: n_kv_heads = 8 does not divide by tensor_parallel_degree 16" in text
    assert "[training] seq_len = 250 must divide by 16" in text
    # A 70B config from the docs with TP 16 (64 query heads divide; 8 key/value heads do not).
    cfg = config("--parallelism.tensor_parallel_degree", "16", toml="llama3_70b")
    problems, _, _ = preflight_problems(cfg, 128, dry_run=True)
    assert any("llama3 70B: n_kv_heads = 8 does not divide by" in p for p in problems), problems
    assert not any("n_heads = 64" in p for p in problems)


def test_the_issue_dry_run_command_ends_in_one_config_error_without_a_traceback(tmp_path):
    command = (
        "titan-train --job.config_file debug_model --dry-run --dry_run.world_size 16 "
        "--parallelism.tensor_parallel_degree 16"
    )
    done = subprocess.run(
        [sys.executable, "-m", "titan_trainer", *shlex.split(command)[1:]],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "titan: config error: titan: config error" not in out
    assert re.search(r"^titan: config error: llama3 debugmodel: n_kv_heads = 8", out, re.M), out


# ----------------------------------------------------------------------------- memory


def test_a_sequence_length_whose_activations_cannot_fit_is_refused_with_numbers_and_fixes():
    spec = resolve(plugins.MODELS, "llama3")
    cpu = torch.device("cpu")
    for seq_len, fits in ((256, True), (100_000, False)):
        cfg = config("--training.seq_len", str(seq_len))
        dims = cfg.parallelism.build_parallel_dims(1)
        with torch.device("meta"):
            model = spec.build(model_args_for(spec, cfg, 320))
        need = rank_need(cfg, [model], dims, 320, cpu, torch.bfloat16, 2.0)
        problem, warning = memory_problem(cfg, [need], cpu)
        if fits:
            assert problem is None and warning is None, problem
            continue
        # 6 blocks x 8 x 100,000 tokens: tens of GiB, far above what any CI machine has free.
        assert need.activations.low > 30 * GiB, need
        assert problem is not None and warning is None
        assert re.match(r"this rank needs [\d.]+ GiB: [\d.]+ GiB for its parameters", problem)
        assert "local batch 8 x seq_len 100,000, activation checkpointing none" in problem
        assert f"the host has {free_bytes(cpu) / GiB:.0f}" in problem or "GiB free" in problem
        assert "lower [training] seq_len or local_batch_size" in problem
        assert "--activation_checkpoint.mode full" in problem


def test_the_activation_estimate_follows_activation_checkpointing():
    cpu = torch.device("cpu")
    estimates = {}
    for mode in ("none", "selective", "full"):
        cfg = config("--training.seq_len", "2048", "--activation_checkpoint.mode", mode)
        dims = cfg.parallelism.build_parallel_dims(1)
        estimates[mode] = activation_bytes(cfg, dims, 320, cpu, torch.bfloat16)
    none, selective, full = estimates["none"], estimates["selective"], estimates["full"]
    assert none.low == none.high and full.low == full.high
    # Full keeps each block's input; selective lies between full and none.
    assert full.high < none.low / 2
    assert (selective.low, selective.high) == (full.low, none.high)
    # Twice the sequence: about twice the activations (SDPA keeps no seq x seq scores).
    cfg = config("--training.seq_len", "4096", "--activation_checkpoint.mode", "none")
    doubled = activation_bytes(
        cfg, cfg.parallelism.build_parallel_dims(1), 320, cpu, torch.bfloat16
    )
    assert 1.8 < doubled.high / none.high < 2.2


def test_the_ranks_on_one_host_are_checked_together_with_the_numbers():
    cpu = torch.device("cpu")
    cfg = config()
    free = free_bytes(cpu)
    each = RankNeed(state=free // 4, activations=None)  # one fits; eight do not
    assert memory_problem(cfg, [each], cpu) == (None, None)
    problem, _ = memory_problem(cfg, [each] * 8, cpu)
    assert problem is not None
    assert problem.startswith(f"the 8 processes on this host need {8 * each.low / GiB:.1f} GiB")
    assert "start fewer processes on this host (NGPU, --nproc_per_node)" in problem


# ----------------------------------------------------------------------------- hints and names


@pytest.mark.parametrize("extra", ["wandb", "plots"])
def test_the_install_hints_name_a_command_that_works_in_the_workspace(extra):
    from titan_trainer.plots import MATPLOTLIB_MISSING

    text = " ".join((WANDB_MISSING if extra == "wandb" else MATPLOTLIB_MISSING).split())
    (command,) = re.findall(r"uv sync [^),]*", text)
    assert f"--extra {extra}" in command
    done = subprocess.run(
        [*shlex.split(command), "--dry-run"], cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_negated_booleans_read_as_false():
    for flag in ("--checkpoint.no-enable", "--checkpoint.no_enable", "--no-checkpoint.enable"):
        cfg = config("--checkpoint.enable", flag)
        assert cfg.checkpoint.enable is False, flag
    assert config("--checkpoint.enable").checkpoint.enable is True


def test_tokenizer_path_wins_over_hf_assets_path_and_a_note_says_so():
    assert Model(hf_assets_path="assets/hf/x").tokenizer_source() == ("assets/hf/x", None)
    assert Model(tokenizer_path="llama3").tokenizer_source() == ("llama3", None)
    name, note = Model(tokenizer_path="byte2", hf_assets_path="assets/hf/x").tokenizer_source()
    assert name == "byte2" and "both set: the tokenizer comes from tokenizer_path" in note
    cfg = config("--model.hf_assets_path", "/nowhere/hf", "--model.tokenizer_path", "byte")
    problems, _, _ = preflight_problems(cfg, 1)  # byte is the default: hf_assets_path's is read
    assert any(p.startswith("[model] hf_assets_path = '/nowhere/hf'") for p in problems), problems


# ----------------------------------------------------------------------------- dry run wording


def test_a_shortfall_below_a_tenth_of_a_gib_is_shown_with_its_digits():
    from titan_trainer.dry_run import gib_text

    assert gib_text(0.04) == "0.04" and gib_text(0.004) == "0.004" and gib_text(2.26) == "2.3"
    assert gib_text(0.0) == "0.0"


def test_the_suggestions_for_a_mixture_of_experts_model_include_expert_parallel():
    from titan_trainer.dry_run.suggest import CHANGES

    def labels(cfg: JobConfig, world: int) -> list[str]:
        return [c.label for c in CHANGES if c.apply(cfg, world) is not None]

    moe = config(toml="qwen3_30b_a3b")
    ep = [label for label in labels(moe, 16) if label.startswith("expert parallel x2")]
    assert ep, labels(moe, 16)
    (change,) = [c for c in CHANGES if c.label == ep[0]]
    changed, world = change.apply(moe, 16)
    assert changed.parallelism.expert_parallel_degree == 16 and world == 16
    assert not preflight_problems(changed, world, dry_run=True)[0]  # a layout that can run
    assert not [x for x in labels(config(toml="llama3_8b"), 8) if x.startswith("expert")]


# ----------------------------------------------------------------------------- restarts


def test_the_restart_notice_under_fault_tolerance_says_a_live_group_heals_it():
    import logging

    from titan_trainer.restarts import restart_notice

    level, text = restart_notice(3, checkpointing=False, fault_tolerance=False)
    assert level == logging.WARNING and "a restart trains again from step 0" in text
    level, text = restart_notice(3, checkpointing=False, fault_tolerance=True)
    assert level == logging.INFO and "from step 0" not in text.split(";")[0]
    assert "receives the weights, optimizer state and step from a live replica group" in text
    assert restart_notice(3, checkpointing=True, fault_tolerance=True) is None


# ----------------------------------------------------------------------------- start-up


def test_a_plain_config_does_not_import_torchao():
    code = (
        "import sys\n"
        "from titan_core import load_config\n"
        "from titan_trainer.config import JobConfig\n"
        f"load_config(JobConfig, ['--job.config_file', {str(CONFIGS / 'debug_model.toml')!r}])\n"
        "assert 'torchao' not in sys.modules\n"
        "load_config(JobConfig, ['--quantize.linear.float8.recipe_name', 'rowwise'])\n"
        "assert 'torchao' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # Named, torchao's import logs nothing either.
    assert "register_constant() on Enum subclasses" not in done.stderr, done.stderr
