"""One run per folder (FolderLock) and the start-up write test (check_writable), with real
processes: two started together, two started 3 s apart, and a holder killed by SIGKILL."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_core import run_folder
from titan_core.run_folder import LOCK_FILE, FolderLock, RunFolderError, check_writable

WORKER = Path(__file__).with_name("lock_worker.py")


def _start(folder: Path, go: Path, hold: float = 30) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), run_folder.__file__, str(folder), str(go), str(hold)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _first_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    if not line.startswith(("HELD", "REFUSED")):
        proc.wait(timeout=10)
        raise AssertionError(
            f"worker failed (exit {proc.returncode}):\n{line}\n{proc.stdout.read()}"
        )
    return line


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def test_two_runs_started_together_exactly_one_gets_the_folder(tmp_path):
    go = tmp_path / "go"
    folder = tmp_path / "run"
    procs = [_start(folder, go) for _ in range(2)]
    try:
        time.sleep(0.5)  # both wait on the go file with the lock code loaded
        go.touch()
        lines = sorted(_first_line(p) for p in procs)
        assert lines[0].startswith("HELD ") and lines[1].startswith("REFUSED "), lines
        holder_pid = int(lines[0].split()[1])
        assert f"pid {holder_pid}" in lines[1] and socket.gethostname() in lines[1]
        assert "another run is using the dump folder" in lines[1]
        refused = next(p for p in procs if p.pid != holder_pid)
        assert refused.wait(timeout=10) == 3
    finally:
        _stop(*procs)


def test_a_run_started_3_s_later_is_refused_with_the_holders_host_and_pid(tmp_path):
    go = tmp_path / "go"
    go.touch()
    first = _start(tmp_path / "run", go)
    try:
        assert _first_line(first) == f"HELD {first.pid}"
        time.sleep(3)
        second = _start(tmp_path / "run", go)
        line = _first_line(second)
        assert second.wait(timeout=10) == 3
        assert line.startswith("REFUSED another run is using the dump folder")
        assert f"host {socket.gethostname()}, pid {first.pid}" in line
        assert "use another folder" in line  # the caller's hint
        assert first.poll() is None  # the holder is untouched
    finally:
        _stop(first)
        if "second" in locals():
            _stop(second)


def test_a_lock_left_by_a_run_killed_with_sigkill_is_taken_over(tmp_path):
    go = tmp_path / "go"
    go.touch()
    first = _start(tmp_path / "run", go)
    assert _first_line(first) == f"HELD {first.pid}"
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stdout.close()
    # The killed run's name is still in the file; only the kernel's lock is gone.
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == first.pid
    second = _start(tmp_path / "run", go, hold=0)
    try:
        assert _first_line(second) == f"HELD {second.pid} TOOK_OVER {first.pid}"
        assert second.wait(timeout=10) == 0
    finally:
        _stop(second)
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released: names nobody


def test_one_process_may_claim_a_folder_twice_and_keeps_it_until_the_last_release(tmp_path):
    a = FolderLock(tmp_path)
    b = FolderLock(tmp_path)  # e.g. the trainer and its checkpointer in one dump folder
    a.release()
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    b.release()
    b.release()  # a second release is harmless
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with FolderLock(tmp_path) as again:
        assert again.taken_over is None  # a released lock is free, not stale


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without file locks (some network mounts): flock fails with ENOLCK."""

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refuse)


def _write_holder(folder: Path, host: str, pid: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    holder = {"host": host, "pid": pid, "started": time.time(), "command": "titan-train"}
    (folder / LOCK_FILE).write_text(json.dumps(holder))


def test_without_file_locks_host_and_pid_decide(tmp_path, no_flock):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_holder(tmp_path / "stale", socket.gethostname(), dead.pid)
    lock = FolderLock(tmp_path / "stale")
    assert lock.taken_over is not None and lock.taken_over.pid == dead.pid
    lock.release()

    _write_holder(tmp_path / "live", socket.gethostname(), os.getppid())
    with pytest.raises(RunFolderError, match=f"pid {os.getppid()}"):
        FolderLock(tmp_path / "live")

    _write_holder(tmp_path / "remote", "some-other-host", 12345)
    with pytest.raises(
        RunFolderError, match=r"another host cannot be checked.*remove .*\.titan\.lock"
    ):
        FolderLock(tmp_path / "remote")


@contextlib.contextmanager
def read_only(path: Path):
    """Make `path` unwritable for this process: chmod for a normal user; for root, which
    ignores modes, the immutable attribute (chattr +i)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i failed here ({done.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_check_writable_creates_the_folder_and_leaves_nothing_behind(tmp_path):
    check_writable(tmp_path / "a" / "b", purpose="dump folder")
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_a_read_only_folder_is_reported_with_the_systems_reason(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder), pytest.raises(RunFolderError) as info:
        check_writable(folder, purpose="checkpoint folder")
    message = str(info.value)
    assert message.startswith(f"the checkpoint folder {folder} is not writable: ")
    assert "Permission denied" in message or "Operation not permitted" in message
    assert "Traceback" not in message


def test_a_path_that_is_a_file_or_a_link_to_one_is_called_that_with_the_fix(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    hint = "point --job.dump_folder at another folder"
    expected = {
        tmp_path / "file": "is a regular file, not a folder",
        tmp_path / "link": f"is a symbolic link to {tmp_path / 'file'}, a regular file, not a folder",
        tmp_path / "dangling": f"is a symbolic link to {tmp_path / 'nowhere'}, which does not exist",
        tmp_path / "file" / "run": f"cannot be created: {tmp_path / 'file'} is a regular file, not a folder",
    }  # fmt: skip
    for path, problem in expected.items():
        with pytest.raises(RunFolderError) as info:
            check_writable(path, purpose="dump folder", hint=hint)
        assert str(info.value) == f"the dump folder {path} {problem}\nmove it away, or {hint}"
    assert (tmp_path / "file").read_text() == "x"  # nothing was touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "file", "link"]


def test_a_folder_in_a_read_only_place_names_that_place(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    with read_only(parent), pytest.raises(RunFolderError) as info:
        check_writable(parent / "run", purpose="checkpoint folder", hint="use another")
    first, fix = str(info.value).splitlines()
    assert first.startswith(
        f"the checkpoint folder {parent / 'run'} cannot be created in {parent}: "
    )
    assert first.endswith(("Permission denied", "Operation not permitted")), first
    assert fix == f"make {parent} writable, or use another"


def test_a_full_disk_leaves_no_probe_file_behind(tmp_path):
    # The probe's name is fixed: make it lead to /dev/full, which fails every write with
    # ENOSPC as a full disk does; the probe (here the link) must be gone afterwards.
    probe = tmp_path / f".titan-write-test-{socket.gethostname()}-{os.getpid()}"
    probe.symlink_to("/dev/full")
    with pytest.raises(RunFolderError) as info:
        check_writable(tmp_path, purpose="checkpoint folder", hint="use another")
    assert str(info.value) == (
        f"the checkpoint folder {tmp_path} is not writable: No space left on device"
        "\nits disk is full: free space there, or use another"
    )
    assert list(tmp_path.iterdir()) == []
