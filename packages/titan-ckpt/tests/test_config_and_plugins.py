"""The [checkpoint] section, the `titan.checkpointers` entry point, a third-party checkpointer
found by `module:attr`, and the README example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from ckpt_toy import assert_same, build_run, full_model, train

from titan_ckpt import Checkpoint, build_checkpointer
from titan_core import ConfigError, ParallelDims, load_config, to_toml
from titan_core.plugins import CHECKPOINTERS, resolve
from titan_core.protocols import Checkpointer

README = Path(__file__).parents[1] / "README.md"


@dataclass
class Root:
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


def test_a_torchtitan_checkpoint_section_loads_and_round_trips(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text(
        '[checkpoint]\nenable = true\nfolder = "ckpt"\ninterval = 50\nasync_mode = "async"\nkeep_latest_k = 2\n'
        'last_save_model_only = true\nexport_dtype = "bfloat16"\nexclude_from_loading = ["dataloader"]\n'
    )
    cfg = load_config(Root, ["--checkpoint.load_step", "100"], toml_path=toml).checkpoint
    assert (cfg.enable, cfg.folder, cfg.interval, cfg.async_mode, cfg.keep_latest_k) == (
        True,
        "ckpt",
        50,
        "async",
        2,
    )
    assert (cfg.export_dtype, cfg.exclude_from_loading, cfg.load_step) == (
        "bfloat16",
        ["dataloader"],
        100,
    )
    again = tmp_path / "again.toml"
    again.write_text(to_toml(Root(cfg)))
    assert load_config(Root, toml_path=again).checkpoint == cfg


def test_invalid_combinations_are_reported_with_the_key_and_a_fix():
    problems = Checkpoint(
        interval=0, keep_latest_k=-1, exclude_from_loading=["modle"], initial_load_in_hf=True
    ).validate()
    text = "\n".join(problems)
    assert "[checkpoint] interval = 0" in text and "keep_latest_k = -1" in text
    assert (
        "unknown state 'modle'" in text
        and "initial_load_in_hf = true needs initial_load_path" in text
    )
    with pytest.raises(ConfigError, match="async_mode"):
        load_config(Root, ["--checkpoint.async_mode", "sometimes"])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the error shown when no GPU is visible"
)
def test_pinned_memory_async_needs_cuda():
    assert any("needs CUDA" in p for p in Checkpoint(async_mode="async_with_pinned_mem").validate())


def test_entry_point_dcp_builds_a_checkpointer_under_the_dump_folder(tmp_path):
    factory = resolve(CHECKPOINTERS, "dcp")
    assert factory is build_checkpointer
    run = build_run()
    cfg = Checkpoint(enable=True, interval=2, folder="ck")
    ckpt = factory(
        cfg,
        states=run.states(),
        dump_folder=str(tmp_path),
        dims=ParallelDims(world_size=1),
        config_toml="",
        dp_rank=0,
    )
    assert isinstance(ckpt, Checkpointer)
    train(run, 2, ckpt)
    ckpt.close()
    assert (tmp_path / "ck" / "step-2" / "titan_commit.json").is_file()


def test_a_third_party_checkpointer_is_resolved_by_module_attr_and_used_the_same_way(tmp_path):
    factory = resolve(CHECKPOINTERS, "ckpt_toy_plugin:build_checkpointer")
    run = build_run(dropout=0.0)
    cfg = Checkpoint(enable=True, interval=2, checkpointer="ckpt_toy_plugin:build_checkpointer")
    ckpt = factory(cfg, states=run.states(), dump_folder=str(tmp_path), dims=None, config_toml="")
    assert isinstance(ckpt, Checkpointer)
    train(run, 2, ckpt)
    ckpt.close()
    fresh = build_run(seed=3, dropout=0.0)
    assert factory(cfg, states=fresh.states(), dump_folder=str(tmp_path)).load() == 2
    assert_same(
        full_model(run.model), full_model(fresh.model), "third-party checkpointer round trip"
    )


def test_readme_example_runs_twice_in_the_same_folder_and_its_commands_work(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for run in ("first", "second"):  # the second run finds the first one's checkpoints
        done = subprocess.run(
            [sys.executable, "-"],
            input=blocks[0],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{run} run:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "outputs" / "checkpoint" / "step-20").is_dir()
    # The command lines the README shows that run as they are on the example's output.
    commands = [
        line
        for line in re.findall(r"```\n(titan-ckpt .*?)```", README.read_text(), re.S)[
            0
        ].splitlines()
        if line.split()[1] in ("list", "verify")
    ]
    assert len(commands) == 2
    for command in commands:
        done = subprocess.run(
            command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
        assert "step-20" in done.stdout or "step       20" in done.stdout, done.stdout
