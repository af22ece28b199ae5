"""A data package (named in the config as `ft_data:data_spec`) for the fault-tolerance test: the
loader of one replica group kills its process with SIGKILL before one batch, in the first
torchrun attempt only (a lost node, as the other groups see it), and the surviving groups can
be held back until the killed group is back, so that the run does not end without it.

Configured by environment:
  FT_START_DIR, FT_START_NAME, FT_START_COUNT: a group of the first attempt creates
    FT_START_DIR/FT_START_NAME before its first batch and waits (at most FT_HOLD_MAX_S seconds)
    until FT_START_COUNT groups have, so that the groups start stepping together however long
    each took to start up (on a loaded machine one group started 10 s after the others, and the
    synchronisations the test choreographs fell at other steps);
  FT_KILL_AT: the batch (counted from 1) before which this group's process dies;
  FT_PASSED_FILE, FT_PASSED_AT: a group of the first attempt creates the file when it reads its
    FT_PASSED_AT-th batch (it has taken the steps before it); the restarted group waits for the
    file when its loader is built (at most FT_HOLD_MAX_S seconds), before it asks to join the
    others (a slow restart: a replacement node, a long start-up, as long as the test needs);
  FT_BACK_FILE: a file the restarted group creates when it reads its FT_BACK_AT-th batch (1);
  FT_SLOW_SECONDS, FT_HOLD_AT: until that file exists, sleep this long before each batch, and
    wait for the file before batch FT_HOLD_AT (at most FT_HOLD_MAX_S seconds), then
    FT_HOLD_EXTRA_S more."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from stall_data import WrappedLoader


class ReplicaTestLoader(WrappedLoader):
    def __init__(self, inner):
        super().__init__(inner)
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.batches = 0  # over the loader's whole life, resumed or not
        if self.attempt > 0 and "FT_PASSED_FILE" in os.environ:
            # The trainer builds the loader before it joins the replica groups.
            _wait_for(Path(os.environ["FT_PASSED_FILE"]))

    def __iter__(self):
        back = Path(os.environ["FT_BACK_FILE"]) if "FT_BACK_FILE" in os.environ else None
        passed = os.environ.get("FT_PASSED_FILE")
        for batch in self.inner:
            self.batches += 1
            if self.batches == 1 and self.attempt == 0 and "FT_START_DIR" in os.environ:
                _start_together()
            if passed and self.attempt == 0 and self.batches == int(os.environ["FT_PASSED_AT"]):
                Path(passed).touch()
            if self.attempt == 0 and self.batches == int(os.environ.get("FT_KILL_AT", "0")):
                os.kill(os.getpid(), signal.SIGKILL)
            if back is not None and self.attempt > 0:
                if self.batches >= int(os.environ.get("FT_BACK_AT", "1")):
                    back.touch()
            elif back is not None and not back.exists() and "FT_SLOW_SECONDS" in os.environ:
                if self.batches >= int(os.environ["FT_HOLD_AT"]):
                    _wait_for(back)
                    time.sleep(float(os.environ.get("FT_HOLD_EXTRA_S", "0")))
                else:
                    time.sleep(float(os.environ["FT_SLOW_SECONDS"]))
            yield batch


def _start_together() -> None:
    folder = Path(os.environ["FT_START_DIR"])
    folder.mkdir(exist_ok=True)
    (folder / os.environ["FT_START_NAME"]).touch()
    count = int(os.environ["FT_START_COUNT"])
    _wait_until(lambda: len(list(folder.iterdir())) >= count, poll_s=0.05)


def _wait_for(path: Path) -> None:
    _wait_until(path.exists, poll_s=0.1)


def _wait_until(done, poll_s: float) -> None:
    """Poll `done` until it holds, at most FT_HOLD_MAX_S seconds (then go on: the test's own
    checks say what went wrong)."""
    deadline = time.monotonic() + float(os.environ.get("FT_HOLD_MAX_S", "300"))
    while not done() and time.monotonic() < deadline:
        time.sleep(poll_s)


data_spec = ReplicaTestLoader.spec("replica_test")
