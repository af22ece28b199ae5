"""bench/vs_torchtitan.py as the GPU machine runs it, from a bundle made with
`tools/gpu_bundle.py --with-torchtitan` (torchtitan 0.2.2 installed with --no-deps beside this
Python's torch), as far as a CPU takes it: `import torchtitan.train` works from the bundle's
folder, the bench refuses to measure without a GPU (exit status 2), `--check` passes, and `--smoke` trains Titan on a toy
flavor while torchtitan gets as far as its CUDA device (torchtitan 0.2.2 cannot train on a CPU:
see the bench's docstring); on a GPU both train and the row's ratio is written.

The first test runs in the default suite (the packaging session: bench/README.md's commands,
about 15 s); all of them, `--check` and `--smoke` too (about a minute and a half), with

    uv run nox -s vs-torchtitan
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> tuple[list[str], list[str]]:
    """bench/README.md's two commands: make the bundle (here), run it (on the GPU machine)."""
    readme = (ROOT / "bench" / "README.md").read_text()
    make, run = (
        [line.split("#")[0].split() for line in readme.splitlines() if line.startswith(start)]
        for start in ("uv run python tools/gpu_bundle.py", "bash gpu-bundle/run_vs_torchtitan.sh")
    )
    assert len(make) == len(run) == 1, (make, run)
    return make[0], run[0]


@pytest.fixture(scope="module")
def run_bench(tmp_path_factory):
    """Runs the bundle's run_vs_torchtitan.sh with the given arguments; the bundle made by
    bench/README.md's command as shown, but for its folder (a temporary one) and
    `--no-third-party` (this environment has the locked packages already; tools/
    test_gpu_bundle.py checks that part of a bundle)."""
    make, _ = readme_commands()
    bundle = tmp_path_factory.mktemp("bundle") / "gpu-bundle"
    argv = [str(bundle) if a == "gpu-bundle" else a for a in make]
    assert argv[:3] == ["uv", "run", "python"] and str(bundle) in argv, make
    subprocess.run(
        [sys.executable, *argv[3:], "--no-third-party"], cwd=ROOT, check=True, timeout=900
    )
    env = {**os.environ, "PYTHON": sys.executable, "PIP": "uv pip",
           "TITAN_TARGET": str(bundle.parent / "site"), "OMP_NUM_THREADS": "1"}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(bundle / "run_vs_torchtitan.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )

    run.bundle = bundle
    return run


# torchtitan 0.2.2 and what it needs beyond the workspace's lock, as wheel names.
TORCHTITAN_WHEELS = ["docstring_parser", "einops", "tomli", "torchdata", "torchtitan",
                     "typeguard", "tyro"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: it measures")
def test_the_bundle_imports_torchtitan_from_its_wheels_and_the_bench_refuses_without_a_gpu(
    run_bench, tmp_path
):
    """bench/README.md's two commands: the bundle holds torchtitan's wheels, and its script, as
    shown (with `--out` in a temporary folder), imports torchtitan from them and refuses to
    measure without a GPU."""
    wheels = sorted(w.name.split("-")[0] for w in (run_bench.bundle / "wheels").glob("*.whl"))
    assert [w for w in wheels if not w.startswith("titan_llm_")] == TORCHTITAN_WHEELS
    _, (bash, script) = readme_commands()
    assert (bash, script) == ("bash", "gpu-bundle/run_vs_torchtitan.sh")
    done = run_bench("--out", str(tmp_path / "out.jsonl"))
    said = done.stdout + done.stderr
    # torchtitan.train imported from the bundle's folder, beside this Python's torch.
    site = run_bench.bundle.parent / "site"
    assert f"vs torchtitan: torchtitan 0.2.2 from {site / 'torchtitan'}" in done.stdout, said
    assert f"titan from {site / 'titan_core'}" in done.stdout, said
    assert done.returncode == 2, said[-3000:]
    assert "vs_torchtitan: no CUDA GPU on this machine" in done.stderr, said[-3000:]
    assert "nothing was measured and no file was written" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_the_cpu_checks_pass_from_the_bundle(run_bench):
    done = run_bench("--check")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    passed = [line for line in done.stderr.splitlines() if line.startswith("vs_torchtitan: ok: ")]
    kinds = [line.split(": ")[2] for line in passed]
    assert kinds == [
        "tokenizer",
        "torchtitan's c4_test loader",
        "configs",
        "models",
        "metrics line",
    ]
    assert "8B-4 1,923,125,248; 8B-8 2,795,573,248" in said  # Llama 3.1 8B's widths, cut


def test_smoke_trains_titan_and_runs_torchtitan_to_its_cuda_device(run_bench, tmp_path):
    out = tmp_path / "smoke.jsonl"
    done = run_bench("--smoke", "--rows", "4l_eager,8l_sac_compiled", "--steps", "4",
                     "--median-from", "2", "--out", str(out))  # fmt: skip
    said = done.stdout + done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    machine, *rest = lines
    assert machine["kind"] == "machine" and machine["torchtitan"] == "0.2.2", machine
    runs = [line for line in rest if line["kind"] == "run"]
    rows = [line for line in rest if line["kind"] == "row"]
    assert [(r["row"], r["framework"]) for r in runs] == [
        ("4l_eager", "torchtitan"), ("4l_eager", "titan"),
        ("8l_sac_compiled", "torchtitan"), ("8l_sac_compiled", "titan"),
    ]  # fmt: skip
    assert [r["row"] for r in rows] == ["4l_eager", "8l_sac_compiled"]
    for run in runs:
        # Both read the same file; torchtitan finds the flavors through its custom import.
        assert run["command"][run["command"].index("--job.config_file") + 1].endswith(
            f"configs/{run['row']}.toml"
        )
        if run["framework"] == "titan" or torch.cuda.is_available():
            assert run["returncode"] == 0, run.get("output_tail")
            assert run["steps_read"] == [1, 2, 3, 4] and run["steps_used"] == 3, run
            assert run["tokens_per_s"] > 0 and run["mfu_pct"] > 0 and run["peak_gib"] > 0
        else:
            # torchtitan 0.2.2 takes "cuda" when no accelerator is present and sets the device
            # right after importing the custom module: its config and that import were accepted.
            output = Path(run["log"]).read_text()
            assert run["returncode"] != 0 and run["steps_read"] == []
            assert "torchtitan_cut_llama3: registered llama3 flavors 8B-4, 8B-8, smoke" in output
            assert "device_module.set_device(self.device)" in run["output_tail"], output
    for row in rows:
        if torch.cuda.is_available():
            assert row["titan_over_torchtitan"] > 0 and isinstance(row["met"], bool), row
        else:
            assert "titan_over_torchtitan" not in row and row["titan"]["tokens_per_s"] > 0
    assert done.returncode == (0 if torch.cuda.is_available() else 1), said[-3000:]
