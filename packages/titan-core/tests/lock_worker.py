"""A process that claims a folder with FolderLock, for test_run_folder.py. It loads
titan_core/run_folder.py by its path (the module needs only the standard library), so that it
starts in milliseconds instead of importing torch.

usage: python lock_worker.py MODULE_FILE FOLDER GO_FILE HOLD_SECONDS

Waits until GO_FILE exists (so that several workers claim at the same moment), then prints
`HELD <pid>` (plus `TOOK_OVER <pid>` when it replaced a dead holder) and holds the folder for
HOLD_SECONDS, or prints `REFUSED <message>` and exits with 3.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time


def main(module_file: str, folder: str, go_file: str, hold_seconds: str) -> int:
    spec = importlib.util.spec_from_file_location("run_folder", module_file)
    run_folder = importlib.util.module_from_spec(spec)
    sys.modules["run_folder"] = run_folder  # dataclasses look their module up there
    spec.loader.exec_module(run_folder)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    try:
        lock = run_folder.FolderLock(folder, purpose="dump folder", hint="use another folder")
    except run_folder.RunFolderError as e:
        print("REFUSED " + str(e).replace("\n", " | "), flush=True)
        return 3
    took = f" TOOK_OVER {lock.taken_over.pid}" if lock.taken_over else ""
    print(f"HELD {os.getpid()}{took}", flush=True)
    time.sleep(float(hold_seconds))
    lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
