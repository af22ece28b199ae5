"""The GPU suite's no-network recipe (tools/gpu_bundle.py), as far as a CPU machine can take
it: the bundle's wheels install with --no-deps into a folder of their own beside this Python's
torch, and its script collects every test marked `gpu` from the installed packages, each
reported skipped with its reason (no CUDA here); with --with-torchtitan, torchtitan 0.2.2 and
what it needs install the same way, `import torchtitan.train` works from them, and
bench/vs_torchtitan.py refuses to measure without a GPU. One bundle serves both tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Wheel file names carry the distribution names (titan-llm-*), normalised with underscores.
WHEELS = ["titan_llm_ckpt", "titan_llm_core", "titan_llm_data", "titan_llm_float8",
          "titan_llm_models", "titan_llm_parallel", "titan_llm_trainer"]  # fmt: skip
# torchtitan 0.2.2 and what it needs beyond the workspace's lock (pure Python but tomli).
TORCHTITAN_WHEELS = ["docstring_parser", "einops", "tomli", "torchdata", "torchtitan",
                     "typeguard", "tyro"]  # fmt: skip


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """The bundle, and beside it `site/`: where both tests install it (the second reinstalls)."""
    bundle = tmp_path_factory.mktemp("bundle") / "gpu-bundle"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bundle.py"), str(bundle), "--no-third-party",
         "--with-torchtitan"],
        check=True,
        timeout=900,
    )  # fmt: skip
    return bundle


def _env(site: Path) -> dict:
    # This Python has torch; `uv pip` installs here (uv's environments carry no pip).
    return {**os.environ, "PYTHON": sys.executable, "PIP": "uv pip", "TITAN_TARGET": str(site)}


def test_the_bundle_installs_without_dependencies_and_skips_every_gpu_test_with_its_reason(
    bundle,
):
    site = bundle.parent / "site"
    wheels = sorted(w.name.split("-")[0] for w in (bundle / "wheels").glob("*.whl"))
    assert wheels == sorted(WHEELS + TORCHTITAN_WHEELS)
    assert (bundle / "repo" / "apps" / "trainer" / "tests" / "test_gpu.py").is_file()
    assert not list((bundle / "repo").glob("*/*/src"))  # only the wheels can be imported
    done = subprocess.run(
        ["bash", str(bundle / "run_gpu_tests.sh")],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert f"gpu suite: titan from {site / 'titan_core' / '__init__.py'}" in done.stdout, said
    # One pytest run per package that has gpu tests, over the files that hold them.
    groups = (bundle / "gpu_test_files.txt").read_text().splitlines()
    assert any("apps/trainer/tests/test_gpu.py" in group.split() for group in groups), groups
    summaries = re.findall(
        r"^(?:=+ )?(.*(?:deselected|skipped|passed|failed).*?)(?: =+)?$", done.stdout, re.M
    )
    assert not any("passed" in s or "failed" in s or "error" in s for s in summaries), summaries
    skipped = re.findall(r"^SKIPPED \[(\d+)\] (\S+?):\d+: (.+)$", done.stdout, re.M)
    by_file = {}
    for count, path, reason in skipped:
        by_file.setdefault(Path(path).name, set()).add(reason)
        assert int(count) >= 1
    assert by_file["test_gpu.py"] == {"needs a CUDA device"}, by_file
    assert by_file["test_block_causal.py"] == {
        "needs CUDA: compiled FlexAttention (Triton) and varlen flash attention run on a GPU only"
    }
    assert sum(int(c) for c, p, _ in skipped if p.endswith("test_gpu.py")) >= 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: it measures")
def test_the_bundle_imports_torchtitan_from_its_wheels_and_the_bench_refuses_without_a_gpu(
    bundle, tmp_path
):
    site = bundle.parent / "site"
    done = subprocess.run(
        ["bash", str(bundle / "run_vs_torchtitan.sh"), "--out", str(tmp_path / "out.jsonl")],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = done.stdout + done.stderr
    # torchtitan.train imported from the bundle's folder, beside this Python's torch.
    assert f"vs torchtitan: torchtitan 0.2.2 from {site / 'torchtitan'}" in done.stdout, said
    assert f"titan from {site / 'titan_core'}" in done.stdout, said
    assert done.returncode == 2, said[-3000:]
    assert "vs_torchtitan: no CUDA GPU on this machine" in done.stderr, said[-3000:]
    assert "nothing was measured and no file was written" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()
