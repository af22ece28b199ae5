"""`titan-train --dry-run`: the commands a user types before booking a cluster, on small jobs.

The shipped configs at their real size and world size are in test_shipped_configs_dry_run.py;
how close the estimate is to measurement is in test_memory_predictor.py.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import DEBUG_TOML, run_cli

from titan_trainer.cli import main as titan_train

SMALL = ["--job.config_file", str(DEBUG_TOML), "--training.seq_len", "64"]


def _titan_train(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`titan-train ARGS` in this process: the dry run simulates each rank in a fresh process
    of its own anyway, and this one has imported the trainer already."""
    code = titan_train(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _table_rows(stdout: str) -> dict[str, list[float]]:
    rows = {}
    for line in stdout.splitlines():
        match = re.match(r"^(every rank|pipeline rank \d+)\s+([\d.\s]+)$", line)
        if match:
            rows[match.group(1)] = [float(x) for x in match.group(2).split()]
    return rows


def test_debug_model_dry_run_prints_the_memory_table_and_fits(tmp_path, capsys, monkeypatch):
    # cuDNN attention, which this CPU lacks: the dry run neither times nor checks the kernel
    # (the job's GPUs do, at start-up). No world size: the debug config's 1 is unset, and an
    # open FSDP degree leaves it to the job, as in every torchtitan TOML; the dry run takes
    # one node of 8 and says so.
    monkeypatch.delenv("NGPU", raising=False)
    result = _titan_train(
        [*SMALL, "--job.dump_folder", str(tmp_path), "--dry-run", "--dry_run.world_size", "none",
         "--model.attention_backend", "cudnn"],
        capsys,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "attention: " not in out + result.stderr
    assert "titan dry run: llama3 debugmodel on 8 x H100 (79.2 GiB)" in out, out
    assert "layout dp_shard 8 | seq 64" in out
    assert (
        "note: world size 8: data_parallel_shard_degree = -1 takes what the job's processes"
        " leave, and neither [dry_run] world_size nor NGPU names them, so one node of 8 GPUs"
        " is assumed, as torchtitan's launcher does; --dry_run.world_size N (or NGPU=N)"
        " simulates another"
    ) in out
    rows = _table_rows(out)
    assert list(rows) == ["every rank"], out
    kinds = rows["every rank"]
    # six kinds, then the step's peak (their sum) and the initialisation's peak
    assert kinds[6] == pytest.approx(sum(kinds[:6]), abs=0.02), kinds
    assert re.search(r"verdict: fits, [\d.]+ GiB free", out), out
    # nothing was trained or written
    assert not (tmp_path / "checkpoint").exists() and "step    1" not in out


def test_torchtitan_spelling_simulates_each_pipeline_rank(tmp_path, capfd):
    # capfd: the rank roles are simulated in processes of their own, which say their parts.
    result = _titan_train(
        [
            *SMALL,
            "--job.dump_folder",
            str(tmp_path),
            "--comm.mode",
            "fake_backend",
            "--dry_run.world_size",  # the debug config simulates one process by default
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--training.local_batch_size",
            "4",
        ],
        capfd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _table_rows(result.stdout)
    assert list(rows) == ["pipeline rank 0", "pipeline rank 1"], result.stdout
    # The work is said as it goes, on stderr: each role as it starts, its parts, its end with
    # the time left (the 405B config's roles take minutes each).
    said = result.stderr
    assert "dry run: simulating pipeline rank 0 (rank 0 of 2) on fake tensors\n" in said, said
    for part in ("model built and parallelised", "training step measured"):
        assert re.search(rf"dry run: pipeline rank 1: {part} \(\d+ s in\)", said), said
    assert re.search(
        r"dry run: pipeline rank 0 simulated: step peak [\d.]+ GiB \(1 of 2 done in \d+ s;"
        r" about \d+ s left\)",
        said,
    ), said
    assert "\ndry run:" not in result.stdout  # the answer stays clean
    # The first stage holds the embedding, the last the output projection and the loss:
    # different ranks, different memory.
    assert rows["pipeline rank 0"] != rows["pipeline rank 1"]


def test_a_job_that_does_not_fit_exits_3_with_each_change_simulated(tmp_path, capfd):
    # Selective op checkpointing, as the 8B config: it keeps the matmuls' outputs, which
    # Float8 leaves in the compute dtype, so Float8 saves nothing here, and says so.
    result = _titan_train(
        [
            *SMALL,
            "--job.dump_folder",
            str(tmp_path),
            "--dry-run",
            "--dry_run.world_size",
            "2",
            "--training.seq_len",
            "512",
            "--activation_checkpoint.mode",
            "selective",
            "--dry_run.device_memory_gib",
            "0.1",
            "--dry_run.headroom_gib",
            "0",
        ],
        capfd,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"verdict: does not fit by [\d.]+ GiB", out), out
    changes = re.findall(r"^  - (.+?): peak ([\d.]+) GiB, (fits|short)", out, re.MULTILINE)
    labels = [c[0] for c in changes]
    assert labels[:2] == [
        "activation checkpointing: full",
        "Float8 linear layers (model.converters += quantize.linear.float8)",
    ], out
    assert "twice the GPUs (FSDP degree x2)" in labels
    baseline = _table_rows(out)["every rank"][6]
    # Recomputing activations must lower the simulated peak.
    assert float(changes[0][1]) < baseline
    assert "cheapest change that fits: activation checkpointing: full" in out, out
    float8 = next(line for line in out.splitlines() if "Float8 linear layers" in line)
    assert float8.endswith(
        "; no lower than now: Float8 runs the matmuls in 8 bits, but what the step keeps for"
        " backward stays in the compute dtype (selective op checkpointing keeps the matmuls'"
        " outputs)"
    ), float8
    # The report alone on stdout: no line of the simulations' own logging between its lines
    # (Float8's per-layer lines), and no torch notice anywhere.
    assert not re.search(r"^\d\d:\d\d:\d\d (INFO|WARNING)", out, re.MULTILINE), out
    assert "is deprecated" not in out + result.stderr and "[rank0]:W" not in result.stderr


def test_every_config_problem_is_reported_together_before_any_simulation(tmp_path, capsys):
    result = _titan_train(
        [
            *SMALL,
            "--job.dump_folder",
            str(tmp_path),
            "--dry-run",
            "--dry_run.world_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "2F2B",
            "--training.dataset",
            str(tmp_path / "missing.jsonl"),
        ],
        capsys,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    out = result.stdout
    assert "pipeline_parallel_schedule = '2F2B' is not a schedule" in out, out
    assert "missing.jsonl" in out and "does not exist" in out, out
    assert "rank role" not in out  # no simulation of a job that cannot start


def test_a_checkpoint_of_another_flavor_is_found_before_the_job_starts(tmp_path, capsys):
    trained = _titan_train(
        [
            *SMALL,
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "--metrics.enable_tensorboard",
            "false",
        ],
        capsys,
    )
    assert trained.returncode == 0, trained.stdout + trained.stderr
    # Two ranks, with the 8 samples a step the checkpoint's data position counts in.
    two_ranks = ["--training.local_batch_size", "4", "--training.global_batch_size", "8"]
    same = _titan_train(
        [
            *SMALL,
            *two_ranks,
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "--dry-run",
            "--dry_run.world_size",
            "2",
        ],
        capsys,
    )
    assert same.returncode == 0, same.stdout + same.stderr
    assert "step-1 (step 1), which loads into this layout" in same.stdout, same.stdout
    other = _titan_train(
        [
            *SMALL,
            *two_ranks,
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.enable",
            "--model.flavor",
            "1B",
            "--dry-run",
            "--dry_run.world_size",
            "2",
        ],
        capsys,
    )
    assert other.returncode == 2, other.stdout + other.stderr
    assert "does NOT load into this layout" in other.stdout
    assert "has other shapes than this model" in other.stdout, other.stdout


def test_checkpoints_that_cannot_fit_on_this_disk_are_part_of_the_one_verdict(tmp_path, capsys):
    # Every step saved and every checkpoint kept: no disk holds them. A launch from here stops
    # for it (exit 2), and so does the dry run's verdict, beside the memory's.
    result = _titan_train(
        [*SMALL, "--job.dump_folder", str(tmp_path), "--dry-run", "--checkpoint.enable",
         "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0",
         "--training.steps", "100000000"],
        capsys,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    verdict = [line for line in result.stdout.splitlines() if line.startswith("verdict:")]
    assert len(verdict) == 1, result.stdout
    assert re.fullmatch(
        r"verdict: does not start: memory fits, with [\d.]+ GiB free on the fullest rank \(peak"
        r" [\d.]+ GiB \+ 4 GiB headroom of 79.2 GiB\), but \[checkpoint\] the checkpoints will not"
        rf" fit on the disk of {re.escape(str(tmp_path))}/checkpoint: .* this run saves 100000000"
        r" \(keep_latest_k = 0 keeps every one\), so it needs .* more and the disk has .* free",
        verdict[0],
    ), verdict
    assert "lower [checkpoint] keep_latest_k" in result.stdout  # the fixes, after the notes
    assert not (tmp_path / "checkpoint").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "2F2B",
            ],
            "is not a schedule",
        ),
        (
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_async_tensor_parallel",
            ],
            "needs CUDA",
        ),
    ],
)
def test_training_run_checks_the_layout_before_creating_process_groups(tmp_path, flags, message):
    # WORLD_SIZE=2 without a second process: if any process group were created, the run would
    # wait for its peer until the timeout instead of failing at once.
    result = run_cli(
        [*SMALL, "--job.dump_folder", str(tmp_path), *flags],
        env_extra={
            "WORLD_SIZE": "2",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        },
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr


def test_training_a_model_this_machine_cannot_hold_stops_before_allocating(tmp_path, capsys):
    # The 8B config on one process: 8B fp32 parameters, gradients and two AdamW states are
    # ~120 GiB, and a step's activations more. The run must say so at once, not allocate.
    result = _titan_train(
        [
            "--job.config_file",
            "llama3_8b",
            "--job.dump_folder",
            str(tmp_path),
            "--training.dataset",
            "pydocs",
            "--training.steps",
            "1",
            # Its ~90 GiB checkpoint would not fit on this disk either: that is checked first.
            "--checkpoint.enable",
            "false",
        ],
        capsys,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "this rank needs " in result.stderr
    assert "119.7 GiB for its parameters, gradients and optimizer state" in result.stderr
    assert "for a step's activations (local batch 1 x seq_len 8,192" in result.stderr
    assert "--dry-run" in result.stderr


def test_all_ranks_simulates_every_pipeline_rank(tmp_path, capsys):
    result = _titan_train(
        [
            *SMALL,
            "--job.dump_folder",
            str(tmp_path),
            "--dry-run",
            "--dry_run.world_size",
            "4",
            "--dry_run.all_ranks",
            "--parallelism.pipeline_parallel_degree",
            "4",
            "--training.local_batch_size",
            "4",
        ],
        capsys,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _table_rows(result.stdout)
    assert list(rows) == [f"pipeline rank {r}" for r in range(4)], result.stdout


def _probe_process(leave_a_process_group: bool) -> tuple[int, int, bool]:
    """(pid, parent pid, whether a process group existed on arrival) of a simulation process."""
    import os

    import torch.distributed as dist

    from titan_parallel.memory_estimate import fake_process_group

    found = dist.is_initialized()
    if leave_a_process_group:
        fake_process_group(8, 3).__enter__()  # never left: as if a simulation had leaked
    return os.getpid(), os.getppid(), found


def test_each_simulation_runs_in_a_fresh_process_forked_from_one_importing_server():
    import concurrent.futures
    import multiprocessing
    import os

    from titan_trainer.dry_run.simulate import fresh_processes

    context = fresh_processes()
    probes = []
    for leave in (True, False):
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            probes.append(pool.submit(_probe_process, leave).result())
    (pid1, parent1, found1), (pid2, parent2, found2) = probes
    assert pid1 != pid2 and not found1 and not found2, probes  # nothing leaks into the next
    if "forkserver" in multiprocessing.get_all_start_methods():
        # Both forked by the one server that imported torch and the trainer, not by us.
        assert parent1 == parent2 != os.getpid(), (probes, os.getpid())


def test_the_dry_run_command_forks_its_simulations_from_itself(monkeypatch):
    """`titan-train --dry-run` has only loaded its config when it simulates: its simulations
    fork from it (on Linux), not from a server that imports torch and the trainer again."""
    import concurrent.futures
    import importlib
    import os
    import sys

    # The modules (the package exports functions of the same names).
    report = importlib.import_module("titan_trainer.dry_run.report")
    simulate = importlib.import_module("titan_trainer.dry_run.simulate")
    from titan_trainer import cli

    declared = []
    monkeypatch.setattr(simulate, "_fork_from_here", False)  # this process's choice, restored
    monkeypatch.setattr(report, "fork_simulations_from_here", lambda: declared.append(True))
    monkeypatch.setattr(report, "dry_run", lambda config, out: 0)
    monkeypatch.setattr(sys, "argv", ["titan-train", "--dry-run"])
    assert cli.main() == 0 and declared == [True]  # the command declares it
    # Called with its arguments from a process where anything may have run: not declared.
    assert cli.main(["--dry-run"]) == 0 and declared == [True]

    simulate.fork_simulations_from_here()
    probes = []
    for leave in (True, False):
        with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=simulate.fresh_processes()
        ) as pool:
            probes.append(pool.submit(_probe_process, leave).result())
    (pid1, parent1, found1), (pid2, parent2, found2) = probes
    assert pid1 != pid2 and not found1 and not found2, probes  # nothing leaks into the next
    if sys.platform == "linux":
        assert parent1 == parent2 == os.getpid(), (probes, os.getpid())
