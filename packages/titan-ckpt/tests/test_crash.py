"""A process killed (SIGKILL) or out of disk space in the middle of a save leaves the previous
checkpoint the newest loadable one, and a restart reaches the uninterrupted run's parameters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ckpt_toy import assert_same, build_run, full_model, train

from titan_ckpt import Checkpoint, CheckpointManager, list_checkpoints

WORKER = Path(__file__).with_name("crash_worker.py")


def _start(folder: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(folder), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _resume_and_finish(folder: Path) -> None:
    """Restart: resume from the newest complete checkpoint and train to step 6, as a job would."""
    expected = build_run()
    train(expected, 6)
    run = build_run(seed=31)
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), run.states(), folder)
    assert manager.load() == 2
    train(run, 4, manager, last_step=6)
    manager.close()
    assert_same(
        full_model(expected.model), full_model(run.model), "parameters after the crash and restart"
    )
    # Besides the checkpoints, only the (released) lock of the run that used the folder.
    assert sorted(p.name for p in folder.iterdir()) == [".titan.lock", "step-2", "step-4", "step-6"]


def test_resume_after_sigkill_during_save_matches_uninterrupted_run(tmp_path):
    proc = _start(tmp_path, "kill")
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith("SAVING 4"):
            break
    else:
        raise AssertionError("worker ended before saving step 4:\n" + "".join(output))
    data = tmp_path / "step-4.tmp" / "__0_0.distcp"
    deadline = time.monotonic() + 120
    while not (data.exists() and data.stat().st_size > 0):
        assert time.monotonic() < deadline, "the step-4 write never started"
        assert proc.poll() is None, "worker exited before it could be killed"
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = data.stat().st_size
    assert written < 384 * 2**20, (
        f"the kill came after the write finished ({written} bytes); make the ballast larger"
    )
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert (tmp_path / "step-4.tmp").is_dir() and not (tmp_path / "step-4").exists()
    _resume_and_finish(tmp_path)


def test_full_disk_during_save_keeps_previous_checkpoint_and_frees_the_space(tmp_path):
    proc = _start(tmp_path, "efbig")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "SAVED 4" not in output, output
    # The kernel's reason in one line, not DCP's "unexpected pos ..." (EFBIG here; a full disk
    # reads "No space left on device", see test_folder.py).
    assert (
        "FAILED CheckpointSaveError: checkpoint save at step 4 failed: File too large;"
        " the previous checkpoint step-2 stays the newest" in output
    ), output
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / "step-4.tmp").exists()  # removed, so that the disk has its space back
    _resume_and_finish(tmp_path)
