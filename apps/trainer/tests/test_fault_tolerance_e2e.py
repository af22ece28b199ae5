"""TorchFT replica groups through the commands the README shows: a lighthouse, and three replica
groups, each its own `run_train.sh` job (torchrun, `MAX_RESTARTS`), on CPU with gloo. One group's
process is killed with SIGKILL mid-run; torchrun restarts it, it receives the current state from
a live group and trains on.

- With `min_replica_size = 2` the two survivors keep stepping while the third is away (held at
  a step until it is back, so that the run cannot end without it), never restart, and all
  three end with bitwise-equal weights.
- With every group required (`min_replica_size` = `group_size`, two of the groups here) no
  step is taken without all of them: the survivor waits, and the run ends with the losses and
  the weights, bitwise, of a run where nothing failed.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAINER, parse_losses, run_cli

from titan_ckpt import load_consolidated

REPO = TRAINER.parents[1]
GROUPS, KILLED, KILL_AT, STEPS = 3, 1, 6, 16
TIMEOUT_S = 400


def _readme_lines() -> tuple[str, list[str]]:
    """The README's lighthouse command and its replica-group commands, one per group."""
    lines = [x.strip() for x in (TRAINER / "README.md").read_text().splitlines()]
    (lighthouse,) = [x for x in lines if x.startswith("torchft_lighthouse ")]
    groups = [x.rstrip(" &") for x in lines if x.startswith("TORCHFT_LIGHTHOUSE=")]
    return lighthouse.rstrip(" &"), groups


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).parent),  # where ft_data lives
    }


@pytest.fixture
def start_lighthouse():
    """Starts the README's lighthouse command on a free port and returns its address; every
    lighthouse started is stopped after the test."""
    procs = []

    def start() -> str:
        command, _ = _readme_lines()
        words = shlex.split(command)
        bind = words.index("--bind") + 1
        words[bind] = re.sub(r":\d+$", ":0", words[bind])
        proc = subprocess.Popen(
            words, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()
        )
        procs.append(proc)
        for line in proc.stdout:  # its first line says where it listens
            if m := re.search(r"listening on: \S+:(\d+)", line):
                # Keep reading what it logs: a full pipe would block the lighthouse, and every
                # quorum after it would time out (many discarded attempts on a slow machine).
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return f"http://localhost:{m.group(1)}"
        raise AssertionError("the lighthouse ended without saying where it listens")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _start_groups(
    lighthouse: str,
    folder: Path,
    extra: list[str],
    envs: dict[int, dict],
    *,
    by_key=False,
    groups: int = GROUPS,
    checked: bool = True,
):
    """Every replica group by the README's command for it, with the lighthouse's real address
    (in TORCHFT_LIGHTHOUSE, or with `by_key` in [fault_tolerance] lighthouse, which wins over
    the README's variable, left pointing where no lighthouse listens) and `extra` arguments;
    returns {group: Popen}. With `checked` false (a reference run, where nothing fails), each
    group's arguments go to torchrun alone, without run_train.sh's config-check process."""
    _, commands = _readme_lines()
    procs = {}
    # The groups take their first step together (ft_data): each starts up in its own time.
    start_together = {"FT_START_DIR": str(folder / "started"), "FT_START_COUNT": str(groups)}
    for g, command in enumerate(commands[:groups]):
        assert f"--fault_tolerance.replica_id {g} " in command
        words = shlex.split(command)
        at = next(i for i, w in enumerate(words) if "=" not in w)
        env = dict(w.split("=", 1) for w in words[:at])
        if by_key:
            extra = [*extra, "--fault_tolerance.lighthouse", lighthouse]
        else:
            env["TORCHFT_LIGHTHOUSE"] = re.sub(
                r"localhost:\d+", lighthouse.split("//")[1], env["TORCHFT_LIGHTHOUSE"]
            )
        script, *args = words[at:]
        args = [a.replace("outputs/", f"{folder}/") for a in args]
        launch = ["bash", str(REPO / script)]
        if not checked:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc_per_node={env.get('NGPU', '1')}", "-m", "titan_trainer",
                      "--job.config_file", env.get("CONFIG_FILE", "debug_model")]  # fmt: skip
        with open(folder / f"group{g}.out", "w") as out, open(folder / f"group{g}.err", "w") as err:
            procs[g] = subprocess.Popen(
                [*launch, *args, *extra],
                cwd=folder,
                stdout=out,
                stderr=err,
                text=True,
                env={**_env(), **env, **start_together, "FT_START_NAME": str(g), **envs.get(g, {})},
                start_new_session=True,  # a timeout stops torchrun and its ranks
            )
    return procs


def _finish(procs, folder: Path) -> dict[int, tuple[str, str]]:
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = {
        g: ((folder / f"group{g}.out").read_text(), (folder / f"group{g}.err").read_text())
        for g in procs
    }
    for g, proc in procs.items():
        assert proc.returncode == 0, (
            f"group {g} failed:\n{outputs[g][0][-2000:]}\n{outputs[g][1][-4000:]}"
        )
    return outputs


def _final_weights(folder: Path, group: int) -> dict[str, torch.Tensor]:
    return load_consolidated(
        folder / f"ft_group{group}" / "checkpoint" / f"step-{STEPS}", progress=False
    )


SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2",
         "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
         "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "4",
         "--training.data_plugin", "ft_data:data_spec"]  # fmt: skip


def _check_command_shape() -> None:
    _, commands = _readme_lines()
    assert len(commands) == GROUPS
    for command in commands:
        assert "apps/trainer/run_train.sh" in command and "MAX_RESTARTS=" in command
        assert "--fault_tolerance.enable" in command
        assert f"--fault_tolerance.group_size {GROUPS}" in command


def _assert_each_step_once(stdout: str) -> None:
    """A surviving group logged every step from its first to the last exactly once. Its first
    may be after step 1: with `--min_replicas 1` a group that starts more than the lighthouse's
    join timeout after the others joins them like a restarted one (it heals at step 2 or 3)."""
    steps = [int(m) for m in re.findall(r"\bstep\s+(\d+) \| loss", stdout)]
    assert steps == list(range(steps[0], STEPS + 1)) and steps[0] < KILL_AT, steps


def _assert_killed_and_recovered(out: tuple[str, str]) -> int:
    """The killed group: torchrun saw SIGKILL and restarted it; it received a later step from
    a live group. Returns that step: the last one it received (a group whose first step
    started after the others' quorum formed also receives step 1 from them, before the kill;
    seen once in CI)."""
    stdout, stderr = out
    assert "exitcode: -9" in stderr, stderr[-3000:]
    steps = re.findall(r"replica group 1 received step (\d+) from a live replica group", stdout + stderr)  # fmt: skip
    assert steps, (stdout + stderr)[-4000:]
    return int(steps[-1])


def test_survivors_keep_stepping_and_the_restarted_group_catches_up(tmp_path, start_lighthouse):
    _check_command_shape()
    back = tmp_path / "back"
    hold = 12  # survivors wait for the restarted group before this batch
    # The killed group stays away until the others have taken two steps without it (they
    # read batch KILL_AT + 2), then restarts.
    envs = {g: {"FT_BACK_FILE": str(back), "FT_SLOW_SECONDS": "0.3", "FT_HOLD_AT": str(hold),
                "FT_PASSED_FILE": str(tmp_path / "passed"), "FT_PASSED_AT": str(KILL_AT + 2)}
            for g in range(GROUPS)}  # fmt: skip
    envs[KILLED] |= {"FT_KILL_AT": str(KILL_AT)}
    procs = _start_groups(
        start_lighthouse(),
        tmp_path,
        [*SMALL, "--fault_tolerance.min_replica_size", "2"],
        envs,
        by_key=True,
    )
    outputs = _finish(procs, tmp_path)
    recovered_at = _assert_killed_and_recovered(outputs[KILLED])
    assert KILL_AT <= recovered_at < STEPS, recovered_at  # steps are left after it
    for g in set(range(GROUPS)) - {KILLED}:
        stdout, stderr = outputs[g]
        # Every step once, no restart, and steps taken by the two groups left.
        _assert_each_step_once(stdout)
        assert "torchrun restart" not in stdout + stderr and "exitcode" not in stderr
        short = [
            s
            for s in range(KILL_AT, recovered_at + 1)
            if re.search(rf"step {s:4d} \|.*\| groups 2\b", stdout)
        ]
        assert short, stdout[-3000:]
        assert re.search(rf"step {STEPS:4d} \|.*\| groups 3\b", stdout), stdout[-2000:]
    weights = [_final_weights(tmp_path, g) for g in range(GROUPS)]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        for k in weights[0]:
            assert torch.equal(other[k], weights[0][k]), k


def test_with_every_group_required_the_run_ends_as_if_nothing_failed(tmp_path, start_lighthouse):
    _check_command_shape()
    # Two of the README's groups (the others' tests run all three): what is checked, that no
    # step is taken without every group, needs no third, and each job starts fewer processes.
    groups = 2
    args = [*SMALL, "--fault_tolerance.group_size", str(groups),
            "--fault_tolerance.min_replica_size", str(groups)]  # fmt: skip
    (tmp_path / "whole").mkdir()
    (tmp_path / "killed").mkdir()
    # Both jobs at once, each with its lighthouse: much of each is start-up, which overlaps.
    envs = {KILLED: {"FT_KILL_AT": str(KILL_AT)}}
    killed_procs = _start_groups(start_lighthouse(), tmp_path / "killed", args, envs, groups=groups)
    # The run where nothing fails is the reference: its groups skip run_train.sh's check.
    whole = _finish(
        _start_groups(
            start_lighthouse(), tmp_path / "whole", args, {}, groups=groups, checked=False
        ),
        tmp_path / "whole",
    )
    killed = _finish(killed_procs, tmp_path / "killed")
    _assert_killed_and_recovered(killed[KILLED])
    for g in range(groups):
        expected = parse_losses(whole[g][0])
        assert sorted(expected) == list(range(1, STEPS + 1))
        got = parse_losses(killed[g][0])
        if g != KILLED:
            assert got == expected, (g, got, expected)
        assert f"groups {groups - 1}" not in killed[g][0]  # no step without both
    reference = _final_weights(tmp_path / "whole", 0)
    for g in range(groups):
        weights = _final_weights(tmp_path / "killed", g)
        for k in reference:
            assert torch.equal(weights[k], reference[k]), (g, k)


def test_diloco_groups_train_on_without_a_killed_group_and_end_equal(tmp_path, start_lighthouse):
    """DiLoCo (synchronising every 4 steps) with one of three groups killed at step 6: the
    others synchronise without it at step 8; restarted from its checkpoint of step 4 (slowly:
    it waits until the others have read batch 9, so that it misses that synchronisation), it
    joins a later one (the others wait for it before step 12), receives the state, DiLoCo's included, and at the last step,
    a synchronisation of all three, every group holds the same weights."""
    _check_command_shape()
    back = tmp_path / "back"
    envs = {
        g: {"FT_BACK_FILE": str(back), "FT_SLOW_SECONDS": "0.1", "FT_HOLD_AT": "12",
            "FT_HOLD_EXTRA_S": "3", "FT_PASSED_FILE": str(tmp_path / "passed"), "FT_PASSED_AT": "9"}
        for g in range(GROUPS)
    }  # fmt: skip
    envs[KILLED] |= {"FT_KILL_AT": str(KILL_AT), "FT_BACK_AT": "4"}
    args = [*SMALL, "--fault_tolerance.min_replica_size", "2",
            "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "4"]  # fmt: skip
    outputs = _finish(_start_groups(start_lighthouse(), tmp_path, args, envs), tmp_path)
    recovered_at = _assert_killed_and_recovered(outputs[KILLED])
    assert recovered_at in (12, 16), recovered_at  # at a synchronisation
    for g in set(range(GROUPS)) - {KILLED}:
        stdout, stderr = outputs[g]
        _assert_each_step_once(stdout)
        assert "torchrun restart" not in stdout + stderr and "exitcode" not in stderr
        assert re.search(r"step    8 \|.*\| groups 2\b", stdout), stdout[-3000:]
    weights = [_final_weights(tmp_path, g) for g in range(GROUPS)]
    for other in weights[1:]:
        for k in weights[0]:
            assert torch.equal(other[k], weights[0][k]), k


def test_fsdp_groups_average_like_one_fsdp_job_of_all_their_ranks(tmp_path, start_lighthouse):
    """HSDP over TorchFT: two replica groups of two FSDP ranks each train like one job of four
    FSDP ranks on the same data (each rank reads the share its place in the job gives it).
    Three steps: the losses of steps 2 and 3 and the weights after the third update all follow
    from gradients averaged across the groups."""
    steps = 3
    # float32: "auto" computes in bfloat16 on CPUs with native bf16 (AVX-512 BF16), where
    # summing the gradients in another order (2 x 2 ranks against 4) moves the loss by ~1e-3.
    args = ["--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "float32",
            "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
            "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", "100",
            "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    two = {g: {"NGPU": "2"} for g in range(2)}
    (tmp_path / "ft").mkdir()
    ft = _start_groups(
        start_lighthouse(), tmp_path / "ft",
        [*args, "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2"],
        two, groups=2,
    )  # fmt: skip
    # The reference through torchrun alone: it is no README command, and run_train.sh would
    # start one more process to check the config first.
    whole = run_cli(
        ["--job.config_file", "debug_model", *args,
         "--parallelism.data_parallel_shard_degree", "4", "--job.dump_folder", str(tmp_path / "whole")],
        nproc=4, timeout=TIMEOUT_S, env_extra={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    outputs = _finish(ft, tmp_path / "ft")
    # The metric line's loss is each group's own (over its 2 ranks): their mean is the job's.
    expected = parse_losses(whole.stdout)
    groups = [parse_losses(outputs[g][0]) for g in range(2)]
    assert sorted(expected) == sorted(groups[0]) == sorted(groups[1]) == list(range(1, steps + 1))
    for step, loss in expected.items():
        assert abs((groups[0][step] + groups[1][step]) / 2 - loss) <= 2e-4, (step, groups, expected)
    reference = load_consolidated(
        tmp_path / "whole" / "checkpoint" / f"step-{steps}", progress=False
    )
    for g in range(2):
        folder = tmp_path / "ft" / f"ft_group{g}" / "checkpoint" / f"step-{steps}"
        weights = load_consolidated(folder, progress=False)
        for k in reference:  # fp32; the sums are only grouped differently
            torch.testing.assert_close(weights[k], reference[k], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- without processes


def test_step_batches_retry_a_discarded_step_and_jump_after_healing():
    from titan_trainer.fault_tolerance import StepBatches

    def read(batches, n):
        return [next(batches) for _ in range(n)]

    # Two microbatches per step; batch i is the integer i.
    b = StepBatches(iter(range(100)), per_step=2)
    assert read(b, 2) == [0, 1]
    b.commit()  # step 1 applied
    assert read(b, 2) == [2, 3]
    b.retry()  # step 2 discarded: attempted again on the same batches
    assert read(b, 2) == [2, 3]
    b.commit()
    # A group at step 3 receives step 6 from a live group (it is attempting step 7) and that
    # step is applied: its next step, 8, reads the batches of step 8.
    assert read(b, 2) == [4, 5]
    b.jump(7 - 3, retry=False)
    assert read(b, 2) == [14, 15]
    b.commit()
    # Received, but the step was discarded: step 12 (attempted as 9) is attempted again.
    assert read(b, 2) == [16, 17]
    b.jump(12 - 9, retry=True)
    assert read(b, 2) == [22, 23]
    # Received the very step it was attempting, discarded: the same batches again.
    b.jump(0, retry=True)
    assert read(b, 2) == [22, 23]


def test_fault_tolerance_problems_name_the_fix(monkeypatch):
    from titan_core import ConfigError
    from titan_trainer.checks import check_config
    from titan_trainer.config import JobConfig
    from titan_trainer.data import data_coordinates
    from titan_trainer.fault_tolerance import fault_tolerance_problems

    config = JobConfig()
    config.fault_tolerance.enable = True
    config.fault_tolerance.group_size = 3
    config.fault_tolerance.replica_id = 3
    with pytest.raises(ConfigError, match=r"replica_id = 3 is outside 0 .. 2"):
        check_config(config, 1)
    config.fault_tolerance.replica_id = 2
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    (problem,) = fault_tolerance_problems(config)
    assert "needs a lighthouse" in problem and "torchft_lighthouse --bind" in problem
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    assert fault_tolerance_problems(config) == []
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    (problem,) = fault_tolerance_problems(config)
    assert "pip install 'titan-llm-trainer[ft]'" in problem

    class Dims:  # a group with 2 data-parallel ranks, this one the second
        def mesh(self, name):
            return type("Mesh", (), {"get_local_rank": lambda s: 1, "size": lambda s: 2})()

    assert data_coordinates(config, Dims()) == (2 * 2 + 1, 3 * 2)
    config.fault_tolerance.enable = False
    assert data_coordinates(config, Dims()) == (1, 2)
