"""A training process for test_remote.py: saves step 2 to an S3 URL, then is SIGKILLed in the
middle of saving step 4, at the point `where` names:

- `data`: while DCP writes the data file (nothing of it has reached the store);
- `commit`: after every rank's files and `.metadata` are stored, before the commit marker
  (what a rename-less store leaves: a complete-looking `step-4/` without its marker).

usage: python s3_crash_worker.py URL data|commit
"""

from __future__ import annotations

import os
import signal
import sys

from ckpt_toy import build_run, train

from titan_ckpt import Checkpoint, CheckpointManager, integrity, layout


def _die(*_args, **_kwargs):
    print("KILLING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main(url: str, where: str) -> None:
    run = build_run()
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), run.states(), url)
    train(run, 2, manager)
    print("SAVED 2", flush=True)
    train(run, 1)
    if where == "data":
        write = integrity._HashingStream.write

        def write_then_die(self, data):
            write(self, data)
            _die()

        integrity._HashingStream.write = write_then_die
    else:
        write_synced = layout.write_synced

        def die_at_marker(path, text):
            if path.name == layout.COMMIT_FILE:
                _die()
            write_synced(path, text)

        layout.write_synced = die_at_marker
    train(run, 1, manager)
    print("SAVED 4", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
