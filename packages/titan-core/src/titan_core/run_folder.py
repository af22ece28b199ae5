"""One run per folder, and folders that can really be written.

`FolderLock` keeps a second run out of a folder that a live run is using (the trainer's dump
folder, a checkpoint folder). The lock is the file `<folder>/.titan.lock`. Its holder keeps an
exclusive `flock` on it for as long as it runs, and the kernel drops that lock when the holder
dies, even by SIGKILL, so a lock left by a killed run is taken over by the next one. What the
file says (host, pid, start time, command) only serves the message a refused run prints.

On file systems without `flock` (some network mounts), the holder's host and pid decide: a
holder on this host whose process is gone is stale and taken over; a holder on another host is
refused, with the command that removes its lock.

`check_writable` creates the folder if needed and writes and removes a small file in it, so a
read-only or full folder is reported at start-up with the system's reason, not at the first save,
and a path that is a file (or a link to one) is called that, with the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = ".titan.lock"

_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunFolderError(RuntimeError):
    """A folder this run needs is held by another run, or cannot be written."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float
    command: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"

    def alive_here(self) -> bool | None:
        """Whether the holder's process still exists: None when it runs on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            return True
        return True


def _me() -> Holder:
    return Holder(socket.gethostname(), os.getpid(), time.time(), " ".join(sys.argv)[:500])


def _read_holder(path: Path) -> Holder | None:
    try:
        data = json.loads(path.read_text())
        return Holder(str(data["host"]), int(data["pid"]), float(data["started"]), data["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Locks this process holds, by folder: a process may open one folder twice (a trainer and its
# checkpointer, or tests that build several managers); the file is locked once and released
# when the last user lets go.
_HELD: dict[str, list] = {}
_HELD_LOCK = threading.Lock()


class FolderLock:
    """An exclusive claim on `folder` by this process; `release()` (or the process's end) frees it.

    Raises RunFolderError naming the live holder when another process holds the folder.
    `purpose` names the folder in messages ("dump folder"); `hint` says what to do instead.
    """

    def __init__(self, folder: str | Path, *, purpose: str = "folder", hint: str = ""):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.taken_over: Holder | None = None
        self._key = os.path.realpath(self.folder)
        self._released = False
        with _HELD_LOCK:
            held = _HELD.get(self._key)
            if held is not None:
                held[1] += 1
                return
            fd, self.taken_over = self._acquire(purpose, hint)
            _HELD[self._key] = [fd, 1]

    def _acquire(self, purpose: str, hint: str) -> tuple[int, Holder | None]:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunFolderError(
                    self._refusal(purpose, hint, self._wait_for_holder())
                ) from None
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                previous = self._claim_without_flock(purpose, hint)
            else:
                # A holder that wrote its name and died without releasing: a killed run.
                previous = _read_holder(self.path)
            me = _me()
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me.__dict__).encode(), 0)
            os.fsync(fd)
            return fd, previous
        except BaseException:
            os.close(fd)
            raise

    def _wait_for_holder(self) -> Holder | None:
        # The holder may have locked the file a moment ago and not written its name yet.
        for _ in range(20):
            holder = _read_holder(self.path)
            if holder is not None:
                return holder
            time.sleep(0.05)
        return None

    def _claim_without_flock(self, purpose: str, hint: str) -> Holder | None:
        holder = _read_holder(self.path)
        if holder is None:
            return None
        alive = holder.alive_here()
        if alive is False:
            return holder
        if alive is None:
            raise RunFolderError(
                self._refusal(purpose, hint, holder)
                + f"\nthis file system has no file locks, so a run on another host cannot be checked;"
                f" if it is gone, remove {self.path}"
            )
        raise RunFolderError(self._refusal(purpose, hint, holder))

    def _refusal(self, purpose: str, hint: str, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else "details not written yet"
        return f"another run is using the {purpose} {self.folder} ({who})" + (
            f"\n{hint}" if hint else ""
        )

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        with _HELD_LOCK:
            held = _HELD.get(self._key)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del _HELD[self._key]
            fd = held[0]
            with contextlib.suppress(OSError):  # a released lock names nobody: it is free
                os.ftruncate(fd, 0)
            os.close(fd)  # drops the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_writable(
    folder: str | Path, *, purpose: str = "folder", hint: str = "point the run at another folder"
) -> None:
    """Create `folder` if needed and write, sync and remove a small file in it; raise
    RunFolderError naming the problem and the fix: a path that is a file (or a link to one) and
    not a folder, a parent that is a file or cannot be written, or the system's reason for a
    failed write ("Read-only file system", "Permission denied", "No space left on device").
    `hint` is the last fix offered (where else to point the run). Nothing is left behind."""
    folder = Path(folder)
    problem = _not_a_folder(folder)
    if problem:
        raise RunFolderError(f"the {purpose} {folder} {problem}\nmove it away, or {hint}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parent = _nearest_existing(folder)
        raise RunFolderError(
            f"the {purpose} {folder} cannot be created in {parent}: {e.strerror or e}"
            f"\nmake {parent} writable, or {hint}"
        ) from e
    probe = folder / f".titan-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        reason = e.strerror or str(e)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise RunFolderError(
            f"the {purpose} {folder} is not writable: {reason}"
            + (
                f" ({e.filename})"
                if str(e.filename) not in (str(folder), str(probe), "None")
                else ""
            )
            + ("\nits disk is full: free space there, or " if full else "\nmake it writable, or ")
            + hint
        ) from e
    finally:
        with contextlib.suppress(OSError):  # also after a failed write: leave nothing behind
            probe.unlink()


def _not_a_folder(path: Path) -> str | None:
    """Why `path` (or the parent it would be created in) cannot be a folder, or None."""
    if path.is_symlink():
        target = path.resolve()
        if not target.exists():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        if not target.is_dir():
            return f"is a symbolic link to {target}, {_kind(target)}, not a folder"
        return None
    if path.exists():
        return None if path.is_dir() else f"is {_kind(path)}, not a folder"
    parent = _nearest_existing(path)
    if not parent.is_dir():
        return f"cannot be created: {parent} is {_kind(parent)}, not a folder"
    return None


def _kind(path: Path) -> str:
    mode = path.stat().st_mode
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a folder"


def _nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (links followed)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
