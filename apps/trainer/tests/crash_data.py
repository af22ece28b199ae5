"""A data package (named in the config as `crash_data:data_spec`) whose loader kills its own
process with SIGKILL before one batch, on one rank, in the first attempt of a torchrun job only:
the way a lost node or an out-of-memory kill looks to the other ranks (no message, no cleanup).
Configured by environment: CRASH_RANK, CRASH_AT (batch index). torchrun numbers its attempts in
TORCHELASTIC_RESTART_COUNT; a restarted attempt runs clean."""

from __future__ import annotations

import os
import signal

from stall_data import WrappedLoader


class CrashingLoader(WrappedLoader):
    def __init__(self, inner):
        super().__init__(inner)
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.at = int(os.environ["CRASH_AT"])
        self.batches = 0  # counted over the loader's whole life, resumed or not

    def __iter__(self):
        for batch in self.inner:
            self.batches += 1
            mine = self.rank == int(os.environ["CRASH_RANK"])
            if self.first_attempt and mine and self.batches == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch


data_spec = CrashingLoader.spec("crash")
