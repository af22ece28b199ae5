"""The test cluster for the multi-node tests: a real SLURM (Debian's slurm-wlm and munge) with
each node in its own network namespace, started by tools/slurm_cluster.py, and what the tests do
with it (submit a job as a user types it, wait for a line or for the end, read its losses).

The tests that use it are marked `cluster` and run in `nox -s cluster`; where the machine
cannot start a cluster (not root, no slurm-wlm or munge, no network namespaces) each is skipped
with that reason (`.ci/run` installs the packages where it runs as root)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))
import slurm_cluster  # noqa: E402  (tools/ is no package)

from titan_trainer.plots import read_scalars  # noqa: E402


def start_cluster(folder: Path, **settings) -> slurm_cluster.Cluster:
    why = slurm_cluster.missing_prerequisites()
    if why:
        pytest.skip(f"no SLURM test cluster on this machine: {why}")
    return slurm_cluster.up(folder, **settings)


def job_env(cluster: slurm_cluster.Cluster, **extra: str) -> dict[str, str]:
    """A user's shell on the cluster: SLURM_CONF names the cluster; uv (the README's one
    prerequisite) is on PATH and UV_PROJECT points it at this checkout, as for `uv run` from
    another folder; no virtual environment is active."""
    uv = shutil.which("uv")
    assert uv, "uv is the README's one prerequisite"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHON", "NPROC_PER_NODE", "MASTER_ADDR")
    }
    env.update(
        PATH=f"{Path(uv).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        SLURM_CONF=cluster.conf,
        UV_PROJECT=str(REPO),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def submission_folder(path: Path) -> Path:
    """A folder to submit from, as a checkout's root looks to the README's commands (the
    scripts under apps/), where the jobs' outputs land."""
    path.mkdir(parents=True)
    (path / "apps").symlink_to(REPO / "apps")
    return path


def sbatch(command: str | list[str], cwd: Path, env: dict[str, str]) -> int:
    """Submit a job as the shell line `command` (or its words) does; returns its id."""
    import shlex

    words = shlex.split(command) if isinstance(command, str) else list(command)
    assert words[0] == "sbatch", words
    done = subprocess.run(
        ["sbatch", "--parsable", *words[1:]], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().split(";")[0])


def job_state(cluster: slurm_cluster.Cluster, job: int) -> tuple[str, str]:
    """(JobState, ExitCode) as scontrol reports them."""
    done = subprocess.run(
        ["scontrol", "show", "job", str(job)], env=cluster.env(), capture_output=True, text=True
    )
    state = re.search(r"JobState=(\S+)", done.stdout)
    code = re.search(r"\bExitCode=(\S+)", done.stdout)
    return (state.group(1) if state else "UNKNOWN", code.group(1) if code else "")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")


def wait_for_job(cluster: slurm_cluster.Cluster, job: int, timeout: float = 600) -> str:
    """Wait until the job has ended (not running, not completing); returns its state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, _ = job_state(cluster, job)
        if state in ENDED:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job} still {job_state(cluster, job)} after {timeout:.0f} s")


def wait_for_line(
    path: Path, pattern: str, timeout: float = 300, poll: float = 0.2, procs=(), after: int = 0
) -> re.Match:
    """Wait until `path` (a job's output, a rank's log) has a line matching `pattern` (in what
    it holds from character `after` on); give up at once when one of `procs` (what writes it)
    has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (found := re.search(pattern, path.read_text()[after:])):
            return found
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(poll)
    text = path.read_text()[-3000:] if path.exists() else "(no file)"
    raise AssertionError(f"no {pattern!r} in {path} (after {timeout:.0f} s at most):\n{text}")


def output(cwd: Path, job: int) -> str:
    """The job's output file, as sbatch's default writes it in the submission folder."""
    return (cwd / f"slurm-{job}.out").read_text()


def losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss, exactly as logged to TensorBoard (float32), over every start of the run
    (a resumed start's steps continue the same series)."""
    return read_scalars(str(dump_folder / "tb")).get("loss", {})


def node_processes(cluster: slurm_cluster.Cluster, node: str, name: str = "python") -> list[str]:
    """The command lines of `name` processes running on `node` (in its namespace)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", cluster.namespace(node)], capture_output=True, text=True
    ).stdout.split()
    found = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if name in cmd.split(" ", 1)[0]:
            found.append(cmd)
    return found
