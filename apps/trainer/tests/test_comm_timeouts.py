"""`[comm]` on real gloo process groups: a rank that stalls ends the job within
`train_timeout_seconds` with one clear message and each surviving rank's flight-recorder
trace, instead of a hang."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

from conftest import DEBUG_TOML, run_cli


def test_a_stalled_rank_ends_the_job_within_the_training_timeout(tmp_path):
    stall = 120  # rank 1 waits this long before its 3rd batch; the others must not
    start = time.monotonic()
    result = run_cli(
        [
            "--job.config_file",
            str(DEBUG_TOML),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "6",
            "--training.data_plugin",
            "stall_data:data_spec",
            "--metrics.log_freq",
            "1",
            "--comm.train_timeout_seconds",
            "5",
            "--comm.trace_buf_size",
            "50",
        ],
        nproc=2,
        timeout=300,
        env_extra={
            "STALL_RANK": "1",
            "STALL_AT": "2",
            "STALL_SECONDS": str(stall),
            "PYTHONPATH": str(Path(__file__).parent),  # where stall_data lives
        },
    )
    elapsed = time.monotonic() - start
    assert result.returncode != 0, result.stdout[-2000:]
    assert elapsed < stall, elapsed  # ended by the timeout, not by the stalled rank waking up
    out = result.stdout + result.stderr
    assert "collectives now time out after 5 s ([comm] train_timeout_seconds" in out, out[-3000:]
    assert (
        "a collective did not complete within 5 s ([comm] train_timeout_seconds) on rank 0" in out
    ), out[-3000:]
    assert "step    2 |" in result.stdout and "step    3 |" not in result.stdout
    trace = tmp_path / "comm_traces" / "rank_0"
    assert trace.is_file(), out[-3000:]
    entries = pickle.loads(trace.read_bytes())["entries"]
    # the last 50 collectives at most, and the one that timed out is among them
    assert 0 < len(entries) <= 50
    assert any(e.get("state") != "completed" for e in entries), [
        e.get("state") for e in entries[-3:]
    ]


def test_the_flight_recorder_is_off_with_a_zero_buffer(tmp_path):
    # The timeout is long enough for the whole (short) run: it completes, and nothing is traced.
    result = run_cli(
        [
            "--job.config_file",
            str(DEBUG_TOML),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--comm.trace_buf_size",
            "0",
            "--metrics.enable_tensorboard",
            "false",
        ],
        nproc=2,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "comm_traces").exists() or not any((tmp_path / "comm_traces").iterdir())
