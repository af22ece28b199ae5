"""A training process for test_crash.py: saves step 2, then is killed (or runs out of file
space) while saving step 4. A large extra state makes the step-4 write take long enough to be
interrupted in the middle.

usage: python crash_worker.py FOLDER kill|efbig
"""

from __future__ import annotations

import resource
import signal
import sys
import time

import torch
from ckpt_toy import build_run, train

from titan_ckpt import Checkpoint, CheckpointManager

BALLAST_MB = 384


class Ballast:
    def __init__(self) -> None:
        self.tensor = torch.ones(BALLAST_MB * 2**20 // 4)

    def state_dict(self) -> dict:
        return {"tensor": self.tensor}

    def load_state_dict(self, state: dict) -> None:
        self.tensor = state["tensor"]


def main(folder: str, mode: str) -> None:
    run = build_run()
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=2), {**run.states(), "ballast": Ballast()}, folder
    )
    train(run, 2, manager)
    print("SAVED 2", flush=True)
    train(run, 1)
    if mode == "efbig":
        # A full disk, as the kernel reports it: writes beyond 64 MiB fail with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (64 * 2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
        try:
            train(run, 1, manager)
        except Exception as e:  # noqa: BLE001 - reported to the test
            print(f"FAILED {type(e).__name__}: {e}", flush=True)
            return
        print("SAVED 4", flush=True)
        return
    print("SAVING 4", flush=True)
    train(run, 1, manager)
    print("SAVED 4", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
