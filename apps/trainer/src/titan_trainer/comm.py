"""Collectives that never hang a job: the timeouts of `[comm]` and what a failed collective
leaves behind.

Until the first step is done (it may compile for minutes) collectives get
`comm.init_timeout_seconds`; after it, `comm.train_timeout_seconds`. A rank that stalls or dies
then ends the job with one message naming the timeout, and each surviving rank writes its
flight-recorder trace (its last `comm.trace_buf_size` collectives) to
`<dump_folder>/comm_traces/rank_<n>` (a rank stopped by torchrun, which sends SIGTERM to the
others once one fails, writes its own too), which PyTorch's analyzer reads:

    python -m torch.distributed.flight_recorder.fr_trace <dump_folder>/comm_traces

(add `--allow-incomplete-ranks` when a rank died without writing one).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from titan_core import dump_flight_recorder, get_logger, set_collective_timeout

log = get_logger("comm")

# How the backends word a collective that did not complete.
_TIMED_OUT = ("Timed out waiting", "timed out", "Watchdog caught collective operation timeout")
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "Broken pipe",
    "Socket closed",
)


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer: printed as one message, no traceback."""


def trace_folder(dump_folder: str) -> str:
    return os.path.join(dump_folder, "comm_traces")


def dump_trace(config, dump_folder: str, rank: int) -> str | None:
    """This rank's flight-recorder trace into the dump folder's comm_traces/ (when it is on)."""
    if not config.comm.trace_buf_size:
        return None
    return dump_flight_recorder(trace_folder(dump_folder), rank)


def start_training_timeout(comm, step: int, world_size: int) -> None:
    """After the first step: collectives of every group time out after train_timeout_seconds
    (said when there are other processes to wait for)."""
    groups = set_collective_timeout(comm.train_timeout_seconds)
    if world_size > 1:
        log.info(
            "step %d done: collectives now time out after %d s ([comm] train_timeout_seconds,"
            " %d process group%s)",
            step,
            comm.train_timeout_seconds,
            groups,
            "" if groups == 1 else "s",
        )


def torchrun_restarts() -> tuple[int, int]:
    """(this attempt's restart number, the most torchrun allows): (0, 0) outside torchrun or
    without `--max-restarts`."""
    return (
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")),
    )


def resume_advice() -> str:
    """What happens next after a rank is lost: torchrun's restart when one is left, else the
    command to run."""
    done, allowed = torchrun_restarts()
    if done < allowed:
        return (
            f"torchrun restarts the job from the newest complete checkpoint by itself"
            f" (restart {done + 1} of {allowed}, --max-restarts)"
        )
    if allowed:
        return (
            f"torchrun's {allowed} restart(s) are used up: run the same command again to resume"
            " from the newest complete checkpoint"
        )
    return (
        "run the same command again to resume from the newest complete checkpoint, or launch"
        " with torchrun --max-restarts N (MAX_RESTARTS=N run_train.sh) to have it restarted"
        " by itself"
    )


@contextlib.contextmanager
def report_collective_failures(
    comm, dump_folder: str, rank: int, started: Callable[[], bool], step: Callable[[], int]
) -> Iterator[None]:
    """Turn a timed-out or broken collective into a `CollectiveError` that says what happened,
    in which step, where this rank's flight-recorder trace went and what to do next."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError is one too
        text = str(e)
        timed_out = any(p in text for p in _TIMED_OUT)
        if not (timed_out or any(p in text for p in _PEER_GONE)):
            raise
        path = (
            dump_flight_recorder(trace_folder(dump_folder), rank) if comm.trace_buf_size else None
        )
        seconds, key = (
            (comm.train_timeout_seconds, "train_timeout_seconds")
            if started()
            else (comm.init_timeout_seconds, "init_timeout_seconds")
        )
        what = (
            f"a collective did not complete within {seconds} s ([comm] {key}) on rank {rank}"
            f" in step {step()}: another rank stalled or died"
            if timed_out
            else f"rank {rank} lost a peer during a collective in step {step()}: another rank died"
        )
        trace = (
            f"\nthis rank's last collectives: {path}"
            f" (python -m torch.distributed.flight_recorder.fr_trace {trace_folder(dump_folder)})"
            if path
            else ""
        )
        raise CollectiveError(
            f"{what}; its log (or torchrun's report of its exit code) says why\n"
            f"{'raise [comm] ' + key + ' if that rank is only slow; ' if timed_out else ''}"
            f"{resume_advice()}{trace}"
        ) from e
