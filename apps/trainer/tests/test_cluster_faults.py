"""What goes wrong on a real cluster, on a real SLURM cluster (tools/slurm_cluster.py; see
test_cluster_slurm.py): preemption and time limits, a node cut off mid-run, a node slow to start
and one that never comes. Each job is the SLURM script run as a user submits it; the resumed
jobs' losses are compared, bit for bit, with the same job run through on one host.

Marked `cluster` (`nox -s cluster`); skipped with the reason where no cluster can be started."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from cluster import (
    job_env,
    job_state,
    losses,
    node_processes,
    output,
    sbatch,
    slurm_cluster,
    start_cluster,
    submission_folder,
    wait_for_job,
    wait_for_line,
)
from conftest import start_cli

from titan_ckpt import layout

pytestmark = pytest.mark.cluster

TESTS = Path(__file__).parent
STEPS = 20
# The debug model, small enough that a step is a fraction of a second on two CPU nodes; every
# step logged (TensorBoard keeps each loss at full precision); the data through a loader that
# can be slowed down (paced_data: the same batches, PACE_SECONDS before each).
SMALL = ["debug_model", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", str(STEPS), "--metrics.log_freq", "1",
         "--metrics.save_plots_folder", "", "--training.data_plugin", "paced_data:data_spec"]  # fmt: skip
SCRIPT = "apps/trainer/scripts/multinode.sbatch"
LOST_AFTER = 10  # LOST_NODE_TIMEOUT for the lost-node job: seconds a node may be silent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = start_cluster(tmp_path_factory.mktemp("cluster"), nodes=2, cpus=1)
    yield started
    slurm_cluster.down(started.dir)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """SMALL run through on one host with the same world size (torchrun, 2 processes): the
    losses every interrupted and resumed job must end with."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    started = start_cli(
        ["--job.config_file", *SMALL, "--job.dump_folder", str(folder)],
        nproc=2,
        env_extra={"PYTHONPATH": str(TESTS)},
    )
    cache = {}

    def result() -> dict[int, float]:
        if not cache:
            done = started.result(900)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
            cache.update(losses(folder))
            assert sorted(cache) == list(range(1, STEPS + 1)), cache
        return cache

    return result


def small_job(interval: int, *sbatch_options: str) -> list[str]:
    return ["sbatch", "--nodes", "2", *sbatch_options, SCRIPT, *SMALL, "--checkpoint.enable",
            "--checkpoint.interval", str(interval), "--job.dump_folder", "outputs/run"]  # fmt: skip


def scontrol(cluster, *args: str) -> str:
    done = subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def late_python(path: Path, node: str, seconds: int, env: dict[str, str]) -> Path:
    """A PYTHON for the SLURM script (its documented variable) that, on `node`, waits
    `seconds` before starting the node's launcher: a node slow to come up (a cold file system,
    a late mount). Everything else runs at once, with the workspace's interpreter."""
    python = subprocess.run(
        ["uv", "run", "--quiet", "--project", env["UV_PROJECT"], "python", "-c",
         "import sys; print(sys.executable)"], env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$(hostname)" = {node} ] && [ "$2" = titan_trainer.launch ]; then sleep {seconds}; fi\n'
        f'exec {python} "$@"\n'
    )
    path.chmod(0o755)
    return path


def sigterm_saves(out: str) -> set[tuple[str, int]]:
    """(rank, step) of every rank's 'SIGTERM: saving a full checkpoint at step N'."""
    found = re.findall(r"\[rank(\d+)\][^\n]*SIGTERM: saving a full checkpoint at step (\d+)", out)
    return {(rank, int(step)) for rank, step in found}


def test_preemption_and_a_time_limit_save_a_checkpoint_and_resubmitting_resumes_bit_exactly(
    cluster, uninterrupted, tmp_path
):
    """1. `scancel --signal=TERM` (a preemption notice) mid-run: every rank, on both nodes,
    saves the same step and stops. 2. The same command resubmitted with a time limit and
    `--signal=TERM@120` resumes from it; once it runs, its limit is brought within the 120 s,
    and SLURM's own signal makes it save again and stop before the limit. 3. Resubmitted once
    more, it finishes. Its losses, over all three jobs, are those of the job run through."""
    folder = submission_folder(tmp_path / "submit")
    env = job_env(cluster, PYTHONPATH=str(TESTS))
    # 1. Preempted: the notice comes after step 3 (each step waits 0.5 s for its batch).
    job = sbatch(small_job(100), folder, {**env, "PACE_SECONDS": "0.5"})
    wait_for_line(folder / f"slurm-{job}.out", r"step +3 \|")
    subprocess.run(["scancel", "--signal=TERM", str(job)], env=cluster.env(), check=True)
    assert wait_for_job(cluster, job) == "FAILED"  # stopped early: not COMPLETED
    out = output(folder, job)
    saved = sigterm_saves(out)
    # Both ranks, one on each node, at the same step: one step after the first rank was told.
    assert {rank for rank, _ in saved} == {"0", "1"}, out
    (first,) = {step for _, step in saved}
    assert 3 <= first < STEPS and layout.is_complete(
        folder / f"outputs/run/checkpoint/step-{first}"
    )

    # 2. A time limit: SLURM signals the job 120 s before its end (each step waits 2.5 s, so
    # that it is still running when the signal comes: SLURM looks at time limits every 30 s).
    job = sbatch(small_job(100, "--time=10", "--signal=TERM@120"), folder,
                 {**env, "PACE_SECONDS": "2.5"})  # fmt: skip
    log = folder / f"slurm-{job}.out"
    wait_for_line(log, rf"resumed at step {first}\b")
    wait_for_line(log, rf"step +{first + 1} \|")
    run_time = re.search(r"RunTime=(\d+):(\d+):(\d+)", scontrol(cluster, "show", "job", str(job)))
    elapsed = int(run_time.group(1)) * 3600 + int(run_time.group(2)) * 60 + int(run_time.group(3))
    # Within the 120 s of --signal, with at least 60 s left before the limit.
    scontrol(cluster, "update", f"JobId={job}", f"TimeLimit={elapsed // 60 + 2}")
    assert wait_for_job(cluster, job) == "FAILED"  # stopped by itself, before its time limit
    out = output(folder, job)
    saved = sigterm_saves(out)
    assert {rank for rank, _ in saved} == {"0", "1"}, out
    (second,) = {step for _, step in saved}
    assert first < second < STEPS, (first, second)

    # 3. Resubmitted: it resumes there and runs to the end.
    job = sbatch(small_job(100), folder, env)
    assert wait_for_job(cluster, job) == "COMPLETED", output(folder, job)[-4000:]
    out = output(folder, job)
    assert f"resumed at step {second}" in out
    assert losses(folder / "outputs/run") == uninterrupted()


def test_a_lost_node_ends_the_job_on_every_node_and_a_resubmission_resumes_bit_exactly(
    cluster, uninterrupted, tmp_path
):
    """Node n2's link is cut while the checkpoint of step 6 is being written. The head node
    names n2 and ends the job; n2 ends its own ranks; SLURM's job ends although n2 is still
    unreachable. The half-written checkpoint is never taken for one: resubmitted (with n2,
    back, slow to start its ranks: 15 s), the job resumes from step 3 and its losses are those
    of the job run through."""
    folder = submission_folder(tmp_path / "submit")
    env = job_env(cluster, PYTHONPATH=str(TESTS), LOST_NODE_TIMEOUT=str(LOST_AFTER))
    job = sbatch(small_job(3), folder, {**env, "PACE_SECONDS": "0.3"})
    log = folder / f"slurm-{job}.out"
    being_written = folder / "outputs/run/checkpoint/step-6.tmp"
    deadline = time.monotonic() + 300
    while not being_written.exists():
        assert time.monotonic() < deadline and job_state(cluster, job)[0] in ("PENDING", "RUNNING")
        time.sleep(0.005)
    slurm_cluster.cut(cluster, "n2")
    cut_at = time.monotonic()
    try:
        wait_for_line(log, r"titan: error: node n2 \(rank 1\) has not been heard from", 120)
        noticed = time.monotonic() - cut_at
        while node_processes(cluster, "n2") and time.monotonic() - cut_at < 120:
            time.sleep(0.5)
        n2_gone = time.monotonic() - cut_at
        while job_state(cluster, job)[0] == "RUNNING" and time.monotonic() - cut_at < 240:
            time.sleep(0.5)
        job_over = time.monotonic() - cut_at
        assert not node_processes(cluster, "n2"), node_processes(cluster, "n2")
    finally:
        slurm_cluster.heal(cluster, "n2")
    assert wait_for_job(cluster, job) == "FAILED"
    out = output(folder, job)
    print(f"lost node: noticed {noticed:.1f} s, n2's processes gone {n2_gone:.1f} s, job over"
          f" {job_over:.1f} s after the cut (LOST_NODE_TIMEOUT {LOST_AFTER} s)")  # fmt: skip
    # The bounds the trainer README gives (a heartbeat is LOST_AFTER / 6 here), with 10 s to
    # spare for a loaded machine: noticed within the timeout and a heartbeat; every process on
    # the lost node gone within the timeout and the ranks' 10 s to stop; the SLURM job over
    # within the timeout, the head's 10 s for its ranks and srun's 5 s after the head.
    assert noticed < LOST_AFTER + 2 + 10, noticed
    assert n2_gone < LOST_AFTER + 2 + 10 + 10, n2_gone
    assert job_over < LOST_AFTER + 2 + 10 + 5 + 10 + 10, job_over
    assert out.count("has not been heard from") == 1, out[-4000:]
    checkpoints = folder / "outputs/run/checkpoint"
    assert not layout.is_complete(checkpoints / "step-6"), sorted(
        p.name for p in checkpoints.iterdir()
    )
    assert layout.is_complete(checkpoints / "step-3")

    # Resubmitted; n2's launcher starts 15 s late (a node slow to come up): the others wait.
    slow = late_python(tmp_path / "slow-python", "n2", 15, env)
    job = sbatch(small_job(3), folder, {**env, "PYTHON": str(slow)})
    assert wait_for_job(cluster, job) == "COMPLETED", output(folder, job)[-4000:]
    out = output(folder, job)
    arrived = re.search(r"titan: 2 nodes arrived in ([\d.]+) s", out)
    assert arrived and float(arrived.group(1)) >= 14, out[-3000:]
    assert "resumed at step 3" in out, out[-3000:]
    assert losses(folder / "outputs/run") == uninterrupted()
    # The remains of the cut save went with the resumed job's first save.
    assert not (checkpoints / "step-6.tmp").exists() and layout.is_complete(checkpoints / "step-6")


def test_a_node_that_never_arrives_is_named_and_the_job_ends(cluster, tmp_path):
    """n2's launcher never starts (it hangs before it, as on a node whose file system stalls):
    after RDZV_TIMEOUT the head node names n2, no rank starts anywhere, and the job ends."""
    folder = submission_folder(tmp_path / "submit")
    env = job_env(cluster, RDZV_TIMEOUT="10")
    hang = late_python(tmp_path / "hanging-python", "n2", 600, env)
    started = time.monotonic()
    job = sbatch(["sbatch", "--nodes", "2", SCRIPT, "debug_model", "--training.steps", "2"],
                 folder, {**env, "PYTHON": str(hang)})  # fmt: skip
    assert wait_for_job(cluster, job, timeout=300) == "FAILED"
    took = time.monotonic() - started
    out = output(folder, job)
    said = re.findall(r"titan: error: 1 of 2 nodes did not arrive within 10 s: n2 \(rank 1\)", out)
    assert len(said) == 1, out[-3000:]
    assert "rank 0 of 2 logs to" not in out  # no rank started
    assert took < 120, took  # the checks, the 10 s, srun ending n2's task
    assert not node_processes(cluster, "n2", "sleep")
