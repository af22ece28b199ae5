"""`[comm]` on real gloo process groups: a rank that stalls ends the job within
`train_timeout_seconds` with one clear message and each surviving rank's flight-recorder
trace, instead of a hang."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

from conftest import DEBUG_TOML, run_cli


def _tiny_run(folder) -> list[str]:
    """The debug config at 64 tokens x 2 sequences, writing into `folder`."""
    return [
        "--job.config_file",
        str(DEBUG_TOML),
        "--job.dump_folder",
        str(folder),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
    ]


def test_a_stalled_rank_ends_the_job_within_the_training_timeout(tmp_path):
    stall = 120  # rank 1 waits this long before its 3rd batch; the others must not
    start = time.monotonic()
    result = run_cli(
        [
            *_tiny_run(tmp_path),
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
            "--metrics.save_plots_folder",  # seconds of matplotlib on the failing rank
            "",
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
    # Rank 0's own log file ends with why it stopped.
    rank0 = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "ERROR titan: stopped: a collective did not complete within 5 s" in rank0, rank0[-3000:]


def test_the_flight_recorder_is_off_with_a_zero_buffer_and_each_rank_logs_to_its_file(tmp_path):
    # The timeout is long enough for the whole (short) run: it completes, and nothing is traced.
    # The same run shows `[logging]`: LOG_RANK=1 puts rank 1 (not rank 0) on the console, and
    # each rank writes every line, its rank first, to a file of its own.
    result = run_cli(
        [
            *_tiny_run(tmp_path),
            "--training.steps",
            "2",
            "--comm.trace_buf_size",
            "0",
            "--metrics.enable_tensorboard",
            "false",
        ],
        nproc=2,
        timeout=300,
        env_extra={"LOG_RANK": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "comm_traces").exists() or not any((tmp_path / "comm_traces").iterdir())
    console = result.stdout.splitlines()
    assert any(line.startswith("[rank1] ") and "step    2 | loss" in line for line in console)
    assert not [line for line in console if line.startswith("[rank0] ") and " INFO " in line]
    for rank in (0, 1):
        lines = (tmp_path / "logs" / f"rank_{rank}.log").read_text().splitlines()
        stamped = [line for line in lines if re.match(r"\[rank\d\] \d{4}-\d\d-\d\d ", line)]
        assert {line[:7] for line in stamped} == {f"[rank{rank}]"}, lines[:5]
        text = "\n".join(lines)
        # From the checks before the run folder could be claimed (kept, then written) to the
        # last step.
        assert "INFO titan.checks: [training] dataset: " in text, text[:3000]
        assert "2 processes on cpu" in text and "step    2 | loss" in text, text[-3000:]
