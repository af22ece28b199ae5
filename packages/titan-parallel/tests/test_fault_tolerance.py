"""TorchFT replica groups on real gloo, a real lighthouse and one process per rank
(tests/ft_worker.py): gradients averaged across groups, a group SIGKILLed mid-step while the
others go on, the restarted group healing from a live one, FSDP2 shards averaged across groups.

The reference is one process replaying, step by step, the average over exactly the groups that
the workers' own records say took part in that step (torchft's semantics: a failed step is
discarded everywhere and retried; a step without a group averages the others)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import ft_worker
import pytest
import torch
from ft_worker import replay

from titan_parallel.fault_tolerance import FaultToleranceConfig, ReplicaGroup, start_lighthouse

# Every rank is a process of its own, forked from one that imported torch and torchft once:
# ten fresh interpreters importing torch take minutes on a busy 2-core machine.
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "torchft", "titan_parallel.fault_tolerance"])
GROUPS = 3
STEPS = 8
KILL_AT = 3
SYNC_STEPS = 3  # LocalSGD and DiLoCo: 8 steps synchronise after steps 3 and 6 (and not at 8)
GROUP_KILLED = 1
RESTART_AFTER = KILL_AT + 2  # the killed group is restarted once the others attempted this step
TIMEOUT_S = 240
# One process's replay against gloo's 3-way sum of the same float32 gradients: the sums differ
# in rounding order only; AdamW's normalised update keeps that near 1e-7 per step (measured
# below 1e-6 over 8+ steps).
REPLAY_RTOL = 1e-5


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    try:
        with socket.socket(family) as s:
            s.bind((host, port))
    except OSError as e:  # only a port in use counts: a machine without IPv6 is no reason
        return e.errno != errno.EADDRINUSE
    return True


def _free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port from that range (what binding
    port 0 gives) can be taken by any outgoing connection between this check and the server's
    own bind (it was, once, in CI: the lighthouse failed with "Address already in use")."""
    low = 32768
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ranges.exists():
        low = int(ranges.read_text().split()[0])
    pool = range(10000, low) if low > 10200 else range(1024, 65536)
    for port in random.Random().sample(pool, 200):
        if _bindable(socket.AF_INET, "127.0.0.1", port) and _bindable(socket.AF_INET6, "::", port):
            return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


class Run:
    """One fault-tolerant run: a lighthouse in this process and a process per rank."""

    def __init__(
        self,
        out: Path,
        *,
        min_replica_size: int = 1,
        kill: bool = False,
        groups: int = GROUPS,
        ranks: int = 1,
        semi_sync: str = "",
        ahead: int = 0,
    ):
        self.out, self.kill, self.groups, self.ranks = out, kill, groups, ranks
        self.restarted = None
        self.extra_ranks: list = []  # ranks other than each group's first
        out.mkdir()
        # min_replicas 1: a quorum forms from whichever groups are alive; the workers' startup
        # barrier makes the first one complete. Short timeouts: a dead group is noticed in ~1 s.
        self.lighthouse = start_lighthouse(
            "127.0.0.1:0", 1, join_timeout_ms=1000, heartbeat_timeout_ms=1000
        )
        self.common = [
            f"--groups={groups}",
            f"--steps={STEPS}",
            f"--min-replica-size={min_replica_size}",
            f"--out={out}",
            f"--lighthouse={self.lighthouse.address()}",
        ]
        if semi_sync:
            self.common += [f"--semi-sync={semi_sync}", f"--sync-steps={SYNC_STEPS}"]
        if ranks > 1:  # FSDP in each group; the second joins late and heals from the first
            self.procs = {
                0: self._start(0),
                1: self._start(1, f"--join-after={out / 'g0r0i0.jsonl'}:{KILL_AT}"),
            }
            return
        self.procs = {
            g: self._start(
                g,
                "--barrier",
                *([f"--kill-at={KILL_AT}"] if kill and g == GROUP_KILLED else []),
                *([f"--start-step={ahead}"] if ahead and g == 0 else []),
            )
            for g in range(groups)
        }

    def _start(self, group: int, *extra: str, incarnation: int = 0):
        """The group's ranks, each a process; the group's first rank stands for it."""
        argv = [f"--group={group}", f"--incarnation={incarnation}", *self.common, *extra]
        env = {"OMP_NUM_THREADS": "1"}
        if self.ranks > 1:
            argv.append("--fsdp")
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        procs = []
        for rank in range(self.ranks):
            env |= {"RANK": str(rank), "WORLD_SIZE": str(self.ranks)}
            log = self.out / f"g{group}i{incarnation}{f'r{rank}' if rank else ''}.log"
            procs.append(_FORKSERVER.Process(target=ft_worker.run, args=(argv, str(log), env)))
            procs[-1].start()
        self.extra_ranks += procs[1:]
        return procs[0]

    def wait(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                victim = self.procs[GROUP_KILLED]
                if self.kill and self.restarted is None and victim.exitcode is not None:
                    assert victim.exitcode == -9, self.log(GROUP_KILLED, 0)
                    # A restart takes a while: the others go on alone (or wait) meanwhile.
                    if self._attempts(0) >= RESTART_AFTER + 2:
                        self.restarted = self._start(GROUP_KILLED, incarnation=1)
                live = [*self.procs.values(), *self.extra_ranks]
                live += [self.restarted] if self.restarted else []
                if all(p.exitcode is not None for p in live):
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"run in {self.out} did not finish in {TIMEOUT_S} s")
        finally:
            for p in [*self.procs.values(), *self.extra_ranks, self.restarted]:
                if p is not None and p.exitcode is None:
                    p.kill()
                    p.join()
            self.lighthouse.shutdown()
        for g, p in self.procs.items():
            if not (self.kill and g == GROUP_KILLED):
                assert p.exitcode == 0, self.log(g, 0)
        assert all(p.exitcode == 0 for p in self.extra_ranks), [
            p.exitcode for p in self.extra_ranks
        ]
        if self.restarted is not None:
            assert self.restarted.exitcode == 0, self.log(GROUP_KILLED, 1)

    def _attempts(self, group: int) -> int:
        """Steps `group` attempted so far (committed or not)."""
        path = self.out / f"g{group}r0i0.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def log(self, group: int, incarnation: int) -> str:
        return (self.out / f"g{group}i{incarnation}.log").read_text()[-4000:]

    def records(self, group: int, incarnation: int = 0) -> list[dict]:
        path = self.out / f"g{group}r0i{incarnation}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def final(self, group: int, incarnation: int = 0) -> torch.Tensor:
        return torch.load(self.out / f"g{group}i{incarnation}.pt")["params"]

    def schedule(self) -> list[list[int]]:
        """Per committed step, the groups whose gradients it averaged, from every record."""
        steps: dict[int, set[int]] = {}
        for path in self.out.glob("g*r0i*.jsonl"):
            group = int(path.name[1 : path.name.index("r")])
            for r in map(json.loads, path.read_text().splitlines()):
                if r["committed"]:
                    steps.setdefault(r["step"], set())
                    if r["participating"]:
                        steps[r["step"]].add(group)
        assert sorted(steps) == list(range(len(steps))), f"a step index is missing: {sorted(steps)}"
        return [sorted(steps[s]) for s in range(len(steps))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs in two waves, each all at once (most of their time is waiting); more at once
    starve a 2-core machine under load until a group's start-up exceeds the 5 s timeouts."""
    base = tmp_path_factory.mktemp("ft")
    done = {}
    for wave in (
        {
            "fsdp": lambda: Run(base / "fsdp", groups=2, ranks=2),
            "no_failure": lambda: Run(base / "no_failure"),
            "killed": lambda: Run(base / "killed", kill=True),
            "killed_min3": lambda: Run(base / "killed_min3", kill=True, min_replica_size=GROUPS),
        },
        {
            "local_sgd": lambda: Run(base / "local_sgd", groups=2, semi_sync="local_sgd"),
            "diloco": lambda: Run(base / "diloco", groups=2, semi_sync="diloco"),
            "diloco_behind": lambda: Run(
                base / "diloco_behind", groups=2, semi_sync="diloco", ahead=SYNC_STEPS
            ),
            "diloco_behind_min2": lambda: Run(
                base / "diloco_behind_min2",
                groups=2,
                semi_sync="diloco",
                ahead=SYNC_STEPS,
                min_replica_size=2,
            ),
        },
    ):
        started = {name: start() for name, start in wave.items()}
        for run in started.values():
            run.wait()
        done |= started
    return done


def test_config_names_inconsistent_keys() -> None:
    from titan_core import ConfigError

    assert FaultToleranceConfig(enable=True, replica_id=2, group_size=3).validate() == []
    bad = FaultToleranceConfig(enable=True, replica_id=3, group_size=3, min_replica_size=4)
    assert bad.validate() == [
        "[fault_tolerance] replica_id = 3 is outside 0 .. 2 (group_size = 3)\n"
        "give each replica group its own index",
        "[fault_tolerance] min_replica_size = 4 is not valid\nuse 1 .. group_size (3)",
    ]
    with pytest.raises(ConfigError, match="replica_id = 3 is outside"):
        ReplicaGroup(bad, {"model": torch.nn.Linear(1, 1)})
    with pytest.raises(ConfigError, match="enable = true"):
        ReplicaGroup(FaultToleranceConfig(), {"model": torch.nn.Linear(1, 1)})


def test_import_without_torchft_names_the_extra() -> None:
    """titan_parallel imports without torchft; using fault tolerance then says what to install."""
    code = (
        "import sys; sys.modules['torchft'] = None\n"  # an import of torchft now fails
        "import titan_parallel\n"
        "from titan_parallel.fault_tolerance import start_lighthouse\n"
        "try:\n    start_lighthouse()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'titan-llm-parallel[ft]'" in out, out


def test_groups_average_gradients_like_one_process(runs) -> None:
    run = runs["no_failure"]
    finals = [run.final(g) for g in range(GROUPS)]
    for g in range(1, GROUPS):
        assert torch.equal(finals[g], finals[0]), f"group {g} differs from group 0"
    schedule = run.schedule()
    assert schedule == [list(range(GROUPS))] * STEPS, schedule
    expected = replay(schedule)
    err = ((finals[0] - expected).norm() / expected.norm()).item()
    assert err < REPLAY_RTOL, err
    print(f"no failure: {STEPS} steps, replay rel err {err:.2e}")


def test_killed_group_survivors_continue_and_restart_heals(runs) -> None:
    run = runs["killed"]
    survivors = [g for g in range(GROUPS) if g != GROUP_KILLED]
    for g in survivors:
        recs = run.records(g)
        committed = [r["step"] for r in recs if r["committed"]]
        # Every step index committed once, in order: none lost, none repeated.
        assert committed == list(range(len(committed))), committed
        # The step in which the group died failed on the survivors and was retried...
        assert any(not r["committed"] and r["step"] == KILL_AT for r in recs), recs
        # ...then they went on without it (2 participants), without restarting.
        short = [r["step"] for r in recs if r["committed"] and r["participants"] == GROUPS - 1]
        assert short and short[0] == KILL_AT, recs
    back = run.records(GROUP_KILLED, 1)
    healed = [r for r in back if r["recovered"]]
    assert len(healed) == 1 and healed[0]["step"] > RESTART_AFTER, back
    assert not healed[0]["participating"]  # the healing step does not count its gradients
    # The restarted group took the step counter it received, not a fresh one.
    assert back[0]["attempts"] > 1, back[0]
    finals = [run.final(g) for g in survivors] + [run.final(GROUP_KILLED, 1)]
    for f in finals[1:]:
        assert torch.equal(f, finals[0])
    schedule = run.schedule()
    assert len(schedule) >= STEPS
    assert schedule[KILL_AT] == survivors and schedule[-1] == list(range(GROUPS)), schedule
    expected = replay(schedule)
    err = ((finals[0] - expected).norm() / expected.norm()).item()
    assert err < REPLAY_RTOL, err
    short = sum(len(s) < GROUPS for s in schedule)
    print(
        f"killed group {GROUP_KILLED} at step {KILL_AT}: {len(schedule)} steps, {short} without"
        f" it, healed at step {healed[0]['step']}; replay rel err {err:.2e}"
    )


def test_min_replica_size_all_groups_waits_and_matches_no_failure(runs) -> None:
    run = runs["killed_min3"]
    for g in range(GROUPS):
        recs = run.records(g) if g != GROUP_KILLED else run.records(g, 1)
        # No step was committed with a group missing.
        assert all(r["participants"] == GROUPS for r in recs if r["committed"]), recs
    # The others waited for the restarted group: the step in which it died failed, and so did
    # their attempts without it.
    waited = [r for r in run.records(0) if not r["committed"]]
    assert len(waited) >= RESTART_AFTER + 2 - KILL_AT and {r["step"] for r in waited} == {KILL_AT}
    finals = [run.final(0), run.final(2), run.final(GROUP_KILLED, 1)]
    assert run.schedule() == [list(range(GROUPS))] * STEPS
    for f in finals:
        # Bitwise: the same steps, the same groups, the same reduction order as no failure.
        assert torch.equal(f, runs["no_failure"].final(0))


def test_fsdp_shards_averaged_across_groups_and_late_group_heals(runs) -> None:
    """2 groups of 2 ranks, FSDP2 inside each: rank i of each group averages its own shard.
    The second group starts late and receives the first's sharded model and optimizer state."""
    run = runs["fsdp"]
    late = run.records(1)
    healed = [r for r in late if r["recovered"]]
    assert len(healed) == 1 and healed[0]["step"] >= KILL_AT, late
    schedule = run.schedule()
    assert schedule[0] == [0] and schedule[-1] == [0, 1], schedule
    final = run.final(0)
    assert torch.equal(run.final(1), final)
    expected = replay(schedule)
    err = ((final - expected).norm() / expected.norm()).item()
    assert err < REPLAY_RTOL, err
    alone = sum(s == [0] for s in schedule)
    print(f"fsdp: {len(schedule)} steps ({alone} before the late group), replay rel err {err:.2e}")


README = Path(__file__).parents[1] / "README.md"


def test_readme_fault_tolerance_commands_run_as_shown(tmp_path) -> None:
    """The README's lighthouse and two replica groups, run exactly as shown (on a free port)."""
    section = README.read_text().split("## Fault tolerance (TorchFT)")[1].split("\n## ")[0]
    (tmp_path / "ft_train.py").write_text(section.split("```python\n")[1].split("```")[0])
    commands = section.split("```bash\n")[1].split("```")[0]
    bin_dir = str(Path(sys.executable).parent)  # python and torchft_lighthouse of this env
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    for _ in range(3):  # another test's server may take the port first: try a new one
        done = subprocess.run(
            ["bash", "-c", commands],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            start_new_session=True,
        )
        if done.returncode == 0 or "Address already in use" not in done.stderr:
            break
        env["PORT"] = str(_free_port())
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout  # two processes share the pipe: their lines may interleave
    weights = dict(re.findall(r"replica (\d) \| done \| weights (-?\d+\.\d{6})", out))
    assert set(weights) == {"0", "1"}, out
    # Both groups end with the same weights: the same steps, each averaging both groups.
    assert weights["0"] == weights["1"], weights
    for replica in "01":  # --min_replicas 2: every step averages both groups
        steps = re.findall(rf"replica {replica} \| step +(\d+) \| groups (\d)", out)
        assert steps == [(str(n), "2") for n in range(1, 21)], out


@pytest.mark.parametrize("method", ["local_sgd", "diloco"])
def test_semi_sync_matches_its_single_process_replay(runs, method) -> None:
    """Two groups step alone and synchronise every SYNC_STEPS steps; each group's weights match
    a one-process replay of the method (not equal to each other at the end: the last steps
    after the last synchronisation are each group's own)."""
    run = runs[method]
    expected = ft_worker.replay_semi_sync(method, 2, STEPS, SYNC_STEPS)
    for g in range(2):
        saved = torch.load(run.out / f"g{g}i0.pt")
        # Both applied, with both groups, none healing, at steps 3 and 6.
        assert [s[:5] for s in saved["synced"]] == [(3, 3, True, 2, False), (6, 6, True, 2, False)]
        torch.testing.assert_close(saved["params"], expected[g], rtol=REPLAY_RTOL, atol=1e-7)
    # Until the last synchronisation the groups agree; after it each took 2 steps on its own.
    assert not torch.equal(
        torch.load(run.out / "g0i0.pt")["params"], torch.load(run.out / "g1i0.pt")["params"]
    )


@pytest.mark.parametrize("min_replica_size", [1, 2])
def test_a_diloco_group_behind_the_others_heals_at_the_synchronisation(
    runs, min_replica_size
) -> None:
    """Group 0 starts at step 4 with the initial weights, as after a synchronisation at step 3
    that failed; group 1 at step 1, as one restarted from the checkpoint of the last applied
    synchronisation (here the start). Neither has applied one, so torchft's own count is equal;
    at group 1's first due step (3) group 0 is at its step 6. Group 1 receives group 0's state
    and step there and ends the synchronisation with the same weights, where it used to
    synchronise with group 0 three steps behind it (and, to the end, alone).

    torchft does not count a healing group: where every group is required (min_replica_size 2
    of 2) that synchronisation is not applied, and both groups go back to the last synchronised
    weights, from the same step."""
    run = runs["diloco_behind" if min_replica_size == 1 else "diloco_behind_min2"]
    applied = min_replica_size == 1
    ahead = torch.load(run.out / "g0i0.pt")["synced"]
    behind = torch.load(run.out / "g1i0.pt")["synced"]
    # (step, step after it, applied, groups counted, healed): the healing group is not counted.
    assert [s[:5] for s in ahead] == [(6, 6, applied, 1, False)]
    assert [s[:5] for s in behind] == [(3, 6, applied, 1, True)]
    torch.testing.assert_close(ahead[0][5], behind[0][5], rtol=0, atol=0)  # received
