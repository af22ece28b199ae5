"""A data package (named in the config as `stall_data:data_spec`) whose loader, on one rank, stops
for a long time before one batch: the way a slow file system or a stuck reader looks to a run.
Configured by environment: STALL_RANK, STALL_AT (batch index), STALL_SECONDS.

`WrappedLoader` is the shared part of such test loaders (crash_data.py has another): the real
loader inside, whose position is the one checkpointed and resumed."""

from __future__ import annotations

import os
import signal
import time

from titan_core import DataSpec
from titan_data import build_dataloader, load_tokenizer


class WrappedLoader:
    def __init__(self, inner):
        self.inner = inner
        self.rank = int(os.environ.get("RANK", "0"))

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    def __getattr__(self, name):
        # Everything else the trainer asks of a loader (merge_state_dicts, tokens_by_source,
        # skipped_rows) is the real loader's.
        return getattr(self.inner, name)

    @classmethod
    def spec(cls, name: str) -> DataSpec:
        """A data package whose loader is this class around the default one."""
        return DataSpec(
            name=name,
            build_tokenizer=load_tokenizer,
            build_dataloader=lambda **kwargs: cls(build_dataloader(**kwargs)),
        )


class StallingLoader(WrappedLoader):
    def __iter__(self):
        for i, batch in enumerate(self.inner):
            if self.rank == int(os.environ["STALL_RANK"]) and i == int(os.environ["STALL_AT"]):
                _stall(float(os.environ["STALL_SECONDS"]))
            yield batch


def _stall(seconds: float) -> None:
    """Sleep `seconds`; a SIGTERM meanwhile (torchrun stopping the ranks once another failed)
    runs the trainer's handler, which writes this rank's flight-recorder trace, and then ends
    the process, as torchrun's SIGKILL would 30 s later (a trainer defers a SIGTERM to the end
    of its step, which a stuck reader never reaches)."""
    trainers = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        if callable(trainers):
            trainers(signum, frame)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        time.sleep(seconds)
    finally:
        signal.signal(signal.SIGTERM, trainers)


data_spec = StallingLoader.spec("stall")
