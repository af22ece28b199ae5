"""The errors a checkpoint user sees, and the one-line reason behind a failed save."""

from __future__ import annotations

import os
import pickle

from torch.distributed.checkpoint.api import CheckpointException

from titan_ckpt.safe_read import UnsafeCheckpointError, weights_only_reason


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank (disk full, I/O error) or was refused (NaN or inf in the
    state); the previous checkpoint is intact and stays the newest."""


class CheckpointLoadError(RuntimeError):
    """No checkpoint could be restored: the one asked for, or every one in the folder, failed
    its checks; the message names each and why."""


def failure_reason(error: BaseException) -> str | None:
    """The operating system's reason behind a failed write ("No space left on device", "File
    too large", "Read-only file system"), found in the exception chain of any rank's failure;
    None when there is none (DCP itself may only say "unexpected pos 704 vs 598")."""
    for failure in _failures(error):
        seen = set()
        cause: BaseException | None = failure
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, OSError) and cause.errno:
                where = f" ({cause.filename})" if cause.filename else ""
                return f"{cause.strerror or os.strerror(cause.errno)}{where}"
            cause = cause.__cause__ or cause.__context__
    return None


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
