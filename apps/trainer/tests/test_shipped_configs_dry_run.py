"""Every shipped config, at its real model size and world size, dry-runs and fits on 80 GB H100s.

The command is the one the trainer README shows. For the 405B config it simulates the first and
the last of its 8 pipeline ranks (the ones whose stages hold the embedding and the loss); the
named nox session `dryrun-405b` simulates all 8. The large mixture-of-experts configs (Qwen3
235B-A22B, DeepSeek-V3 236B and 671B, Llama 4 Scout and Maverick) are simulated in the named
session `dryrun-moe` (one to three minutes each here); the default suite checks what needs no
simulation: each config at its world size, and its real-size model split by the trainer's own
parallelize path under a fake group of that size.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from conftest import TRAINER, run_cli

CONFIGS = {
    "debug_model": [],
    "llama3_8b": [],
    "llama3_8b_128k": [],
    "llama3_70b": [],
    "llama3_405b": [],
    "qwen3_moe_debug": [],
    "qwen3_30b_a3b": [],
    "deepseek_v3_debug": [],
    "deepseek_v3_16b": [],
    "llama4_debug": [],
    "gpt_oss_debug": [],
    "gemma3_debug": [],
    "gemma3_27b": [],
    "kimi_k2_debug": [],
}
# The large mixture-of-experts configs, each with expert parallel: their simulations take one to
# three minutes each and run in `uv run nox -s dryrun-moe` (the trainer README has their peaks).
# The default suite checks what needs no simulation: each config's checks at its world size, and
# its real-size model split by the trainer's own parallelize path under a fake group of that
# size, on the meta device. Config -> (world size, layout, the last rank's local w1 of its first
# MoE layer, published parameters in billions or None under PP):
SESSION_ONLY = {
    # 128 experts / EP 8 = 16 per rank, split by FSDP over the 16 ranks EP leaves: 1 each.
    "qwen3_235b_a22b": (128, "dp_shard 128 (ep 8)", [1, 4096, 1536], 235.1),
    # 160 / EP 8 = 20 per rank, which 16 FSDP ranks cannot split whole: their rows (dim 5120/16).
    "deepseek_v3_236b": (128, "dp_shard 128 (ep 8)", [20, 320, 1536], 236),
    # 256 / EP 64 = 4 per rank, split by FSDP over the 2 ranks EP leaves in the stage's 128.
    "deepseek_v3_671b": (2048, "dp_shard 128 x pp 16 (ep 64)", [2, 7168, 2048], None),
    # 16 / EP 16 = 1 per rank, its rows split by FSDP over 4 (dim 5120/4).
    "llama4_scout": (64, "dp_shard 64 (ep 16)", [1, 1280, 8192], 108),
    # 128 / EP 8 = 16 per rank, their rows split by FSDP over 32 (dim 5120/32).
    "llama4_maverick": (256, "dp_shard 256 (ep 8)", [16, 160, 8192], 401),
    # 384 / EP 64 = 6 per rank, split by FSDP over the 2 ranks EP leaves in the stage's 128.
    "kimi_k2_1t": (2048, "dp_shard 128 x pp 16 (ep 64)", [3, 7168, 2048], None),
    # 32 / EP 8 = 4 per rank; EP takes all 8 ranks, so FSDP leaves them whole. Parameters: the
    # published 20.91B less the two 201,088 x 2,880 vocabulary tables (5.5% of this small
    # model), which the config's byte tokenizer shrinks to its own vocabulary.
    "gpt_oss_20b": (8, "dp_shard 8 (ep 8)", [4, 2880, 2880], 20.91 - 1.16),
    # 128 / EP 8 = 16 per rank, split by FSDP over the 8 ranks EP leaves: 2 each.
    "gpt_oss_120b": (64, "dp_shard 64 (ep 8)", [2, 2880, 2880], 116.83 - 1.16),
}


def test_every_shipped_config_is_covered():
    shipped = sorted(p.stem for p in (TRAINER / "configs").glob("*.toml"))
    assert shipped == sorted([*CONFIGS, *SESSION_ONLY])
    noxfile = (TRAINER.parents[1] / "noxfile.py").read_text()
    for name in SESSION_ONLY:
        assert f'"{name}",' in noxfile.split('name="dryrun-moe"')[1], name


@pytest.fixture(scope="module")
def splits() -> dict:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("split_at_size.py")), *SESSION_ONLY],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(SESSION_ONLY))
def test_large_moe_config_splits_at_full_size_over_its_ranks(name, splits):
    world, layout, expert_w1, billions = SESSION_ONLY[name]
    report = splits[name]
    assert report["problems"] == [], report["problems"]
    assert report["layout"] == layout
    assert report["expert_w1"] == expert_w1, report
    if billions is not None:
        # FSDP splits every parameter over all the ranks (the largest evenly): within 3%.
        share = billions * 1e9 / world
        assert abs(report["local_parameters"] - share) < 0.03 * share, (report, share)


# Simulated in `nox -s slow` only (one to three minutes here; its checks and memory table are
# the trainer README's): keeps the default suite's time down.
SLOW = {"gemma3_27b"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CONFIGS]
)
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
    # Memory fits on 80 GB H100s. The verdict also says whether a launch from here would start:
    # a large config's checkpoints need more disk than most machines that dry-run it have
    # (the 70B config's 1.5 TiB), and then it says so, with exit 2, as the launch would.
    disk = re.search(
        r"^note: checkpoint: about .* needs up to ([\d.,]+ \w+) more .*, ([\d.,]+ \w+) free there$",
        out,
        re.M,
    )
    if disk and _bytes(disk[1]) > _bytes(disk[2]):
        assert result.returncode == 2, out[-4000:] + result.stderr[-4000:]
        assert re.search(
            r"verdict: does not start: memory fits, with [\d.]+ GiB free on the fullest rank .*,"
            r" but \[checkpoint\] the checkpoints will not fit on the disk of",
            out,
        ), out
    else:
        assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
        assert re.search(r"verdict: fits, [\d.]+ GiB free", out), out
    sizes = {"debug_model": 1, "llama3_8b": 8, "llama3_8b_128k": 32, "llama3_70b": 64,
             "llama3_405b": 512,
             "qwen3_moe_debug": 1, "qwen3_30b_a3b": 16, "deepseek_v3_debug": 1,
             "deepseek_v3_16b": 8, "llama4_debug": 1, "gpt_oss_debug": 1, "gemma3_debug": 1,
             "gemma3_27b": 64, "kimi_k2_debug": 1}  # fmt: skip
    assert f"on {sizes[name]} x H100" in out, out
    # The predicted step time, priced on the H100 system, every line saying it is a prediction.
    assert "predicted step time on DGX H100 (a model, not a measurement" in out, out
    m = re.search(
        r"^predicted: ([\d.e-]+) s per step, ([\d,]+) tokens/s per device, MFU ([\d.]+)%", out, re.M
    )
    assert m and float(m[1]) > 0 and int(m[2].replace(",", "")) > 0, out
    assert 0 < float(m[3]) < 100, out
    if name == "llama3_8b_128k":  # the header names the context-parallel style and the packing
        assert "layout dp_shard 4 x cp 8 all-to-all | seq 131072" in out, out
        assert "| packed documents" in out, out
    toml = tomllib.loads((TRAINER / "configs" / f"{name}.toml").read_text())
    if toml.get("compile", {}).get("enable"):  # compiled blocks and loss, simulated
        assert "compiled code as inductor runs it" in out, out
    print(out)  # the table, for the log


def _bytes(size: str) -> float:
    """`1,536.0 GiB` -> bytes."""
    number, unit = size.split()
    return float(number.replace(",", "")) * 2 ** {"KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[unit]


# Gemma 3's smaller real flavors have no config of their own: the 27B config with the flavor and
# a world size such a model is trained on (`nox -s slow`, a minute or two each here).
GEMMA3_FLAVORS = {"1B": 8, "4B": 16, "12B": 32}


@pytest.mark.slow
@pytest.mark.parametrize("flavor", list(GEMMA3_FLAVORS))
def test_gemma3_smaller_flavors_dry_run_at_a_realistic_size_and_fit(flavor, tmp_path):
    world = GEMMA3_FLAVORS[flavor]
    result = run_cli(
        [
            *("--job.config_file", "gemma3_27b", "--dry-run"),
            *("--model.flavor", flavor, "--dry_run.world_size", str(world)),
            *("--job.dump_folder", str(tmp_path)),
            # memory only: the 27B config's checkpoint schedule asks for terabytes of disk
            *("--checkpoint.enable", "false"),
        ],
        timeout=1500,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert re.search(r"verdict: fits, [\d.]+ GiB free", out), out
    assert f"on {world} x H100" in out and f"gemma3 {flavor}" in out, out
    print(out)
