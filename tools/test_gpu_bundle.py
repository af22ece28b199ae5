"""The GPU suite's no-network recipe (tools/gpu_bundle.py), as far as a CPU machine can take
it: the bundle's wheels install with --no-deps into a folder of their own beside this Python's
torch, and its script collects every test marked `gpu` from the installed packages, each
reported skipped with its reason (no CUDA here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Wheel file names carry the distribution names (titan-llm-*), normalised with underscores.
WHEELS = ["titan_llm_ckpt", "titan_llm_core", "titan_llm_data", "titan_llm_float8",
          "titan_llm_models", "titan_llm_parallel", "titan_llm_trainer"]  # fmt: skip


def test_the_bundle_installs_without_dependencies_and_skips_every_gpu_test_with_its_reason(
    tmp_path,
):
    bundle, site = tmp_path / "gpu-bundle", tmp_path / "site"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bundle.py"), str(bundle), "--no-third-party"],
        check=True,
        timeout=900,
    )
    assert sorted(w.name.split("-")[0] for w in (bundle / "wheels").glob("*.whl")) == WHEELS
    assert (bundle / "repo" / "apps" / "trainer" / "tests" / "test_gpu.py").is_file()
    assert not list((bundle / "repo").glob("*/*/src"))  # only the wheels can be imported
    # This Python has torch; `uv pip` installs here (uv's environments carry no pip).
    env = {**os.environ, "PYTHON": sys.executable, "PIP": "uv pip", "TITAN_TARGET": str(site)}
    done = subprocess.run(
        ["bash", str(bundle / "run_gpu_tests.sh")],
        env=env,
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


def test_only_third_party_takes_just_the_named_locked_packages_and_refuses_others(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_bundle import third_party_requirements

    lines = third_party_requirements({"torchao", "datasets"})
    assert sorted(line.split("==")[0] for line in lines) == ["datasets", "torchao"], lines
    assert all(re.fullmatch(r"[a-z-]+==[\w.]+", line) for line in lines), lines  # pinned
    with pytest.raises(SystemExit) as refused:
        third_party_requirements({"torchao", "torch", "no-such-package"})
    assert "--only-third-party names no-such-package, torch, which uv.lock does not hold" in str(
        refused.value
    )
