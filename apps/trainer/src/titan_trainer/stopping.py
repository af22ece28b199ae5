"""How a run stops: a SIGTERM (preemption, or torchrun stopping the ranks) asks for a checkpoint
and a clean stop at the end of the step, which every rank reaches at the same step; and at the
end, whatever ended the run, its pieces are closed in an order that keeps the run's own error
the one reported. The checkpoint saved on the way is `titan_trainer.checkpointing`'s."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from titan_core import get_logger
from titan_trainer.run import Run

log = get_logger("train")


class StopRequest:
    """SIGTERM (a scheduler's preemption notice, or torchrun stopping the ranks after one
    failed) asks the loop to checkpoint and stop. This rank's flight-recorder trace is written
    at once too: a rank stuck outside a collective would otherwise leave none."""

    def __init__(self, on_signal=None) -> None:
        self.requested = False
        self.interrupted = False
        self._previous = None
        self._previous_int = None
        self._on_signal = on_signal

    def __enter__(self) -> StopRequest:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._previous_int = signal.signal(signal.SIGINT, self._interrupt)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if self._on_signal is not None:
            self._on_signal()

    def _interrupt(self, signum, frame) -> None:
        """Ctrl-C: the loop stops before its next step. A KeyboardInterrupt raised wherever
        the signal lands can be swallowed (one raised inside a finalizer is only printed), so
        the first Ctrl-C is a flag the loop reads; a second one interrupts at once."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True

    def __exit__(self, exc_type, *_) -> None:
        if self._previous is None:
            return
        signal.signal(signal.SIGINT, self._previous_int)
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            # Stopping on an error: when a peer died, torchrun's SIGTERM follows within
            # moments, and it must not end this rank before its error is reported.
            signal.signal(signal.SIGTERM, lambda *_: None)
            return
        signal.signal(signal.SIGTERM, self._previous)


class StopAgreement:
    """Every rank stops at the same step. A SIGTERM reaches a job's ranks at slightly different
    moments (each node's slurmstepd or torchrun delivers its own), and a rank that stopped to
    save while another went on into the next step would leave both waiting on collectives that
    never match. So each step every rank posts whether it was asked to stop: an all-reduce of
    one number, on a CPU group of its own (nothing else runs on it, so no background save's
    collectives can interleave), started without waiting. Its result is read at the end of the
    next step, when it has long arrived: the job stops one step after the first rank was asked,
    every rank at that step, and no step waits for it. One process decides alone, at once."""

    def __init__(self, world_size: int) -> None:
        self.group = None
        if world_size > 1 and dist.is_initialized() and dist.get_backend() != "fake":
            self.group = dist.new_group(backend="gloo")
        self._flag: torch.Tensor | None = None
        self._work = None

    def poll(self, requested: bool) -> bool:
        """Once per step, on every rank: whether every rank stops after this step."""
        if self.group is None:
            return requested
        decided = False
        if self._work is not None:
            self._work.wait()
            decided = bool(self._flag.item())
        self._flag = torch.tensor([int(requested)], dtype=torch.int32)
        self._work = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return decided

    def close(self, *, after_error: bool) -> None:
        """The last step's post has to arrive before the group goes. After an error a peer
        may be gone: it is left."""
        if self._work is not None and not after_error:
            self._work.wait()
        self._work = None


def close_run(run: Run, *, after_error: bool) -> None:
    """The run's end, however it came: the checkpointer's in-flight save finished, the loader's
    worker processes stopped (before the interpreter exits), the coordination ended."""
    run.checkpoints.close(after_error=after_error)
    run.data.loader.close()
    run.coordinator.close()
