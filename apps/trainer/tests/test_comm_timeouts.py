"""`[comm]` on real gloo process groups: a rank that stalls ends the job within
`train_timeout_seconds` with one clear message and each surviving rank's flight-recorder
trace, instead of a hang."""

from __future__ import annotations

import pickle
import subprocess
import sys
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
    traces = tmp_path / "comm_traces"
    entries = pickle.loads((traces / "rank_0").read_bytes())["entries"]
    # the last 50 collectives at most, and the one that timed out is among them
    assert 0 < len(entries) <= 50
    assert any(e.get("state") != "completed" for e in entries), entries[-1]
    # The stalled rank wrote its trace when torchrun stopped it; PyTorch's analyzer, run as the
    # README shows, names it as the rank that never joined the collective.
    assert (traces / "rank_1").is_file()
    analysis = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(traces)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = analysis.stdout + analysis.stderr  # the analyzer logs its findings to stderr
    assert "missing ranks: {1}" in report, report[-3000:]


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
