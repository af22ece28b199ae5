"""The errors a checkpoint user sees, and the one-line reason behind a failed save."""

from __future__ import annotations

import os
import pickle

from torch.distributed.checkpoint.api import CheckpointException

from titan_ckpt.integrity import CorruptDataError
from titan_ckpt.safe_read import UnsafeCheckpointError, weights_only_reason
from titan_core.protocols import CheckpointError, StateMismatchError


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (disk full, I/O error) or was refused (NaN or inf in the
    state); the previous checkpoint is intact and stays the newest."""


class CheckpointLoadError(CheckpointError):
    """No checkpoint could be restored: the one asked for, or every one in the folder, failed
    its checks; the message names each and why, and what to do."""


class CheckpointNotFoundError(CheckpointLoadError, FileNotFoundError):
    """The step asked for (`load_step`) has no complete checkpoint in the folder."""

    def __str__(self) -> str:  # not OSError's "[Errno ...]" form
        return str(self.args[0]) if self.args else ""


def os_error(error: BaseException) -> OSError | None:
    """The operating system's error behind a failed write, found in the exception chain of
    any rank's failure; None when there is none."""
    for failure in _failures(error):
        seen = set()
        cause: BaseException | None = failure
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, OSError) and cause.errno:
                return cause
            cause = cause.__cause__ or cause.__context__
    return None


def failure_reason(error: BaseException) -> str | None:
    """The operating system's reason behind a failed write ("No space left on device", "File
    too large", "Read-only file system"); None when there is none (DCP itself may only say
    "unexpected pos 704 vs 598")."""
    cause = os_error(error)
    if cause is None:
        return None
    where = f" ({cause.filename})" if cause.filename else ""
    return f"{cause.strerror or os.strerror(cause.errno)}{where}"


def _raised(error: BaseException, kind: type[BaseException]) -> str | None:
    """The message of the first `kind` in any rank's failure or its causes, or None."""
    for failure in _failures(error):
        seen = set()
        cause: BaseException | None = failure
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, kind):
                return str(cause)
            cause = cause.__cause__ or cause.__context__
    return None


def corrupt_data(error: BaseException) -> str | None:
    """What a read found corrupt (CorruptDataError on any rank), or None."""
    return _raised(error, CorruptDataError)


def state_mismatch(error: BaseException) -> str | None:
    """What a state refused to load because it was saved under other settings
    (StateMismatchError on any rank), or None."""
    return _raised(error, StateMismatchError)


def first_line(error: BaseException) -> str:
    """`Type: first line of the message` of the first rank's failure; a weights_only refusal
    from torch (DCP reads tensors with it) without torch's advice to load unsafely."""
    failure = next(iter(_failures(error)), error)
    if isinstance(failure, pickle.UnpicklingError) and not isinstance(
        failure, UnsafeCheckpointError
    ):
        return (
            f"refused to load a saved tensor: {weights_only_reason(failure)}; a checkpoint holds"
            " tensors and plain Python values only, and never runs code"
        )
    text = str(failure).strip().splitlines()
    return f"{type(failure).__name__}: {text[0]}" if text else type(failure).__name__


def _failures(error: BaseException) -> list[BaseException]:
    # DCP gathers every rank's exception into one CheckpointException (a BaseException).
    if isinstance(error, CheckpointException):
        found = []
        for failure in error.failures.values():
            exc = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(exc, BaseException):
                found.append(exc)
        return found or [error]
    return [error]
