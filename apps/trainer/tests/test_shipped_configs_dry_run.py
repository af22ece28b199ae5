"""Every shipped config, at its real model size and world size, dry-runs and fits on 80 GB H100s.

The command is the one the trainer README shows. For the 405B config it simulates the first and
the last of its 8 pipeline ranks (the ones whose stages hold the embedding and the loss); the
named nox session `dryrun-405b` simulates all 8.
"""

from __future__ import annotations

import re

import pytest
from conftest import TRAINER, run_cli

CONFIGS = {
    "debug_model": [],
    "llama3_8b": [],
    "llama3_70b": [],
    "llama3_405b": [],
    "qwen3_moe_debug": [],
    "qwen3_30b_a3b": [],
}


def test_every_shipped_config_is_covered():
    shipped = sorted(p.stem for p in (TRAINER / "configs").glob("*.toml"))
    assert shipped == sorted(CONFIGS)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shipped_config_dry_runs_at_its_documented_size_and_fits(name, tmp_path):
    result = run_cli(
        [
            "--job.config_file",
            f"apps/trainer/configs/{name}.toml",
            "--dry-run",
            "--job.dump_folder",
            str(tmp_path),
            *CONFIGS[name],
        ],
        timeout=1500,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert re.search(r"verdict: fits, [\d.]+ GiB free", out), out
    sizes = {"debug_model": 1, "llama3_8b": 8, "llama3_70b": 64, "llama3_405b": 512,
             "qwen3_moe_debug": 1, "qwen3_30b_a3b": 16}  # fmt: skip
    assert f"on {sizes[name]} x H100" in out, out
    print(out)  # the table, for the log
