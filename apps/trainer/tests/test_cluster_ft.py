"""TorchFT replica groups across nodes, on a real cluster's nodes (tools/slurm_cluster.py: each
node in its own network namespace, its own name on 127.0.1.1 in its hosts file): the README's
lighthouse on n1, the README's replica-group commands one per node. n2's link is cut mid-run:
the group on n1 keeps stepping alone; the link comes back, the group on n2 is brought forward
by the live one, and both end with the same weights.

Marked `cluster` (`nox -s cluster`); skipped with the reason where no cluster can be started."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cluster import REPO, job_env, slurm_cluster, start_cluster, wait_for_line
from test_fault_tolerance_e2e import SMALL, STEPS, _readme_lines

from titan_ckpt import load_consolidated

pytestmark = pytest.mark.cluster

TESTS = Path(__file__).parent
CUT_AT = 4  # n2's link goes down once group 0 has logged this step


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = start_cluster(tmp_path_factory.mktemp("cluster"), nodes=2, cpus=1)
    yield started
    slurm_cluster.down(started.dir)


def test_a_replica_group_on_a_cut_node_is_healed_by_the_live_one(cluster, tmp_path):
    lighthouse, groups = _readme_lines()
    head = cluster.addresses["n1"]
    # The workspace's bin on PATH too, where torchft_lighthouse is.
    env = job_env(cluster, PYTHONPATH=str(TESTS))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    # ft_data: the groups take their first step together; each step waits 0.5 s for its batch,
    # and group 0 waits before batch 14 until group 1 is back (the test says so), so that the
    # run cannot end without it.
    back = tmp_path / "back"
    common = {"FT_START_DIR": str(tmp_path / "started"), "FT_START_COUNT": "2",
              "FT_SLOW_SECONDS": "0.5", "FT_BACK_FILE": str(back), "FT_HOLD_AT": "14",
              "FT_HOLD_MAX_S": "240"}  # fmt: skip
    (tmp_path / "apps").symlink_to(REPO / "apps")  # the README's relative script path
    procs = []
    try:
        words = shlex.split(lighthouse.rstrip(" &"))
        procs.append(slurm_cluster.run_on(
            cluster, "n1", *words, cwd=tmp_path, env=env,
            stdout=open(tmp_path / "lighthouse.out", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
        ))  # fmt: skip
        for g, node in enumerate(("n1", "n2")):
            words = shlex.split(groups[g].replace("localhost", head))
            at = next(i for i, w in enumerate(words) if "=" not in w)
            variables = dict(w.split("=", 1) for w in words[:at])
            args = [a.replace("outputs/", f"{tmp_path}/") for a in words[at + 1 :]]
            group_env = {**env, **variables, **common, "FT_START_NAME": str(g)}
            procs.append(slurm_cluster.run_on(
                cluster, node, "bash", words[at], *args, *SMALL,
                "--fault_tolerance.group_size", "2",
                cwd=tmp_path, env=group_env, stdout=open(tmp_path / f"group{g}.out", "w"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            ))  # fmt: skip
        group0, group1 = tmp_path / "group0.out", tmp_path / "group1.out"
        wait_for_line(group0, rf"step +{CUT_AT} \|", 300, procs=procs)
        slurm_cluster.cut(cluster, "n2")
        cut_at = len(group0.read_text())
        # Group 1 may have healed once already as it started (step 1 from group 0, when its
        # first step began after group 0's): only a heal after the cut is the recovery.
        cut_at1 = len(group1.read_text()) if group1.exists() else 0
        try:
            # Group 0 goes on alone: a step averaged over 1 group (after the cut: a group that
            # took its first steps before the other joined logged some too).
            alone = wait_for_line(
                group0, r"step +(\d+) \|[^\n]*\| groups 1\b", 180, procs=procs[:2], after=cut_at
            )
        finally:
            slurm_cluster.heal(cluster, "n2")
        healed = wait_for_line(
            group1,
            r"replica group 1 received step (\d+) from a live replica group",
            240,
            after=cut_at1,
        )
        back.touch()
        for proc in procs[1:]:
            assert proc.wait(timeout=300) == 0, "\n".join(
                (tmp_path / f"group{g}.out").read_text()[-3000:] for g in range(2)
            )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out0 = group0.read_text()
    steps = [int(s) for s in re.findall(r"\bstep\s+(\d+) \| loss", out0)]
    assert steps == list(range(steps[0], STEPS + 1)), steps  # every step once, no restart
    assert int(alone.group(1)) > CUT_AT and int(healed.group(1)) > CUT_AT
    assert re.search(rf"step {STEPS:4d} \|.*\| groups 2\b", out0), out0[-2000:]
    weights = [
        load_consolidated(
            tmp_path / f"ft_group{g}" / "checkpoint" / f"step-{STEPS}", progress=False
        )
        for g in range(2)
    ]
    for name, value in weights[0].items():
        assert torch.equal(weights[1][name], value), name
    print(f"fault tolerance across nodes: group 0 alone from step {alone.group(1)}, group 1"
          f" received step {healed.group(1)} ({time.strftime('%H:%M:%S')})")  # fmt: skip
