"""Elastic restarts through the command the README shows: `MAX_RESTARTS=N run_train.sh`. One rank
is killed with SIGKILL mid-run (no message, no cleanup, as a lost process looks); torchrun stops
the other, restarts both, they resume from the newest complete checkpoint, and the job finishes
with the losses of a run where nothing failed, step for step."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from conftest import TRAINER, parse_losses, start_cli

REPO = TRAINER.parents[1]
KILLED_RANK, KILLED_AT = 1, 8  # rank 1 dies fetching the batch of step 8 (first attempt only)


def _readme_line() -> tuple[dict[str, str], list[str]]:
    """The README's restart command: its environment and its words from the script on."""
    (line,) = [
        x
        for x in (TRAINER / "README.md").read_text().splitlines()
        if x.strip().startswith("MAX_RESTARTS=")
    ]
    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if "=" not in w)
    return dict(w.split("=", 1) for w in words[:at]), words[at:]


def _run(words: list[str], env: dict[str, str], cwd: Path, extra: list[str]):
    script, *args = words
    proc = subprocess.Popen(
        ["bash", str(REPO / script), *args, *extra],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).parent),  # where crash_data lives
            **env,
        },
        start_new_session=True,  # a timeout stops torchrun and every rank it started
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_a_killed_rank_is_restarted_and_the_job_ends_as_if_nothing_failed(tmp_path):
    env, words = _readme_line()
    assert words[0] == "apps/trainer/run_train.sh" and int(env["MAX_RESTARTS"]) >= 1
    assert "--checkpoint.enable" in words
    small = ["--training.seq_len", "64", "--training.local_batch_size", "2",
             "--metrics.log_freq", "1", "--metrics.save_plots_folder", ""]  # fmt: skip
    steps = int(words[words.index("--training.steps") + 1])
    interval = int(words[words.index("--checkpoint.interval") + 1])
    assert interval < KILLED_AT <= steps  # a checkpoint exists before the kill, steps after it

    # The two jobs side by side (each is two one-thread ranks; much of a job is start-up). The
    # uninterrupted reference, the README command's arguments on as many ranks, runs through
    # torchrun alone: run_train.sh would start one more process to check the config first.
    crash = {"CRASH_RANK": str(KILLED_RANK), "CRASH_AT": str(KILLED_AT)}
    reference = ["--job.config_file", env.get("CONFIG_FILE", "debug_model"), *words[1:],
                 *small, "--job.dump_folder", str(tmp_path / "whole")]  # fmt: skip
    whole_job = start_cli(reference, nproc=int(env["NGPU"]), env_extra={"OMP_NUM_THREADS": "1"})
    elastic = _run(words, {**env, **crash}, tmp_path,
                   [*small, "--job.dump_folder", str(tmp_path / "elastic"),
                    "--training.data_plugin", "crash_data:data_spec"])  # fmt: skip
    whole = whole_job.result(300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = elastic.stdout + elastic.stderr
    assert elastic.returncode == 0, out[-4000:]

    # torchrun saw rank 1 die by SIGKILL and restarted the job once.
    assert f"local_rank: {KILLED_RANK}" in elastic.stderr and "exitcode: -9" in elastic.stderr
    # The surviving rank said what happened, where, and what comes next, without a traceback
    # on the console.
    resumed_from = (KILLED_AT - 1) // interval * interval
    rank0 = (tmp_path / "elastic" / "logs" / "rank_0.log").read_text()
    assert (
        f"rank 0 lost a peer during a collective in step {KILLED_AT}: another rank died" in rank0
    ), rank0[-3000:]
    allowed = env["MAX_RESTARTS"]
    assert (
        f"torchrun restarts the job from the newest complete checkpoint by itself (restart 1 of {allowed}"
        in rank0
    )
    assert f"torchrun restart 1 of {allowed}: training goes on from step {resumed_from}" in out
    assert "Traceback" not in elastic.stdout
    # The steps after the checkpoint ran twice; the last run of each gives the whole run's loss.
    expected, got = parse_losses(whole.stdout), parse_losses(elastic.stdout)
    assert sorted(expected) == sorted(got) == list(range(1, steps + 1))
    assert got == expected, (got, expected)
    for step in range(resumed_from + 1, KILLED_AT):
        assert elastic.stdout.count(f"step {step:4d} |") == 2, step
    folder = tmp_path / "elastic" / "checkpoint"
    saved = sorted(
        int(p.name.split("-")[1]) for p in folder.iterdir() if p.name.startswith("step-")
    )
    assert saved[-1] == steps and resumed_from in saved
