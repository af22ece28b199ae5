"""A SIGTERM that reaches one rank stops every rank at the same step: the ranks agree on it (each
step posts whether any rank was asked to stop; the result is read a step later), save one
checkpoint there together and stop. Across nodes the notice reaches each node's ranks at its own
moment; here rank 1 alone is signalled, the extreme of that."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from conftest import DEBUG_TOML, start_cli

from titan_ckpt import layout

TESTS = Path(__file__).parent


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of the process torchrun (`torchrun_pid`) started as `rank`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path):
    run = tmp_path / "run"
    started = start_cli(
        ["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(run),
         "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.steps", "200", "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
         "--checkpoint.enable", "--checkpoint.interval", "1000",
         "--training.data_plugin", "paced_data:data_spec"],
        nproc=2,
        env_extra={"PYTHONPATH": str(TESTS), "PACE_SECONDS": "0.2"},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    log = run / "logs" / "rank_1.log"
    while not (log.exists() and re.search(r"step +2 \|", log.read_text())):
        assert time.monotonic() < deadline and started.proc.poll() is None, "no step 2"
        time.sleep(0.2)
    pid = _rank_pid(started.proc.pid, 1)
    assert pid is not None
    os.kill(pid, signal.SIGTERM)  # rank 1 only; rank 0 is never signalled
    done = started.result(180)  # without agreement: rank 0 steps on, rank 1 waits in its save
    out = done.stdout + done.stderr
    saved = {}
    for rank in (0, 1):
        text = (run / "logs" / f"rank_{rank}.log").read_text()
        found = re.findall(r"SIGTERM: saving a full checkpoint at step (\d+)", text)
        assert len(found) == 1, (rank, text[-2000:])
        saved[rank] = int(found[0])
    assert saved[0] == saved[1], saved
    assert layout.is_complete(run / "checkpoint" / f"step-{saved[0]}"), out[-3000:]
    assert "exitcode: 143" in done.stderr or "exitcode : 143" in done.stderr, done.stderr[-3000:]
