"""The checkpoint folder belongs to one run, must be writable from the start, and a failed
write names its real cause; a forced (preemption) save is always full and resumable."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_toy import build_run, train
from ckpt_toy_hf import ToyAdapter, ToyArgs

import titan_core.run_folder
from titan_ckpt import Checkpoint, CheckpointManager, list_checkpoints
from titan_ckpt.dcp_io import checkpoint_keys
from titan_ckpt.errors import failure_reason
from titan_ckpt.integrity import ChecksummingWriter
from titan_ckpt.layout import read_commit
from titan_core import RunFolderError

# Holds a folder with titan_core's FolderLock, loaded by path (it needs only the standard
# library), so that the holder starts in milliseconds.
HOLDER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("run_folder", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["run_folder"] = module
spec.loader.exec_module(module)
lock = module.FolderLock(sys.argv[2])
print("HELD", flush=True)
time.sleep(120)
"""


def _manager(run, folder, **cfg):
    cfg = {"interval": 2, **cfg}
    return CheckpointManager(Checkpoint(enable=True, **cfg), run.states(), folder)


def test_a_second_run_on_a_held_folder_is_refused_until_its_holder_is_gone(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, titan_core.run_folder.__file__, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(RunFolderError) as info:
            _manager(build_run(), tmp_path)
        message = str(info.value)
        assert message.startswith(f"another run is using the checkpoint folder {tmp_path} (host ")
        assert f"pid {holder.pid}" in message and "its own [checkpoint] folder" in message
    finally:
        holder.send_signal(signal.SIGKILL)  # a killed run leaves its lock file behind
        holder.wait()
        holder.stdout.close()
    run = build_run()
    with caplog.at_level(logging.WARNING, logger="titan"):
        manager = _manager(run, tmp_path)
    assert f"from a run that is gone (host {os.uname().nodename}, pid {holder.pid}" in caplog.text
    train(run, 2, manager)
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_a_manager_that_only_loads_does_not_claim_the_folder(tmp_path):
    run = build_run()
    writer = _manager(run, tmp_path)
    train(run, 2, writer)
    # e.g. an evaluation job reading the checkpoints of a run that is still going
    reader = CheckpointManager(Checkpoint(), build_run(seed=2).states(), tmp_path)
    assert reader.load() == 2
    writer.close()


def _read_only(path: Path):
    """chmod for a normal user; root ignores modes, so the immutable attribute for root."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return lambda: path.chmod(0o755)
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i failed here ({done.stderr.strip()})")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_checkpoint_folder_is_reported_when_the_manager_is_built(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    undo = _read_only(folder)
    try:
        with pytest.raises(RunFolderError) as info:
            _manager(build_run(), folder)
    finally:
        undo()
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"the checkpoint folder {folder} is not writable: ")
    assert first.endswith(("Permission denied", "Operation not permitted"))


def test_a_full_disk_is_named_as_such(tmp_path):
    # /dev/full fails every write with ENOSPC, as a full disk does. DCP itself reports only
    # "unexpected pos ..."; the reason is further down the exception chain.
    (tmp_path / "__0_0.distcp").symlink_to("/dev/full")
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save(
            {"w": torch.ones(4096)},
            storage_writer=ChecksummingWriter(str(tmp_path)),
            no_dist=True,
        )
    assert "No space left on device" not in str(info.value).splitlines()[0]
    assert failure_reason(info.value) == "No space left on device"


def test_a_forced_save_is_full_resumable_and_synchronous_whatever_the_last_save_settings(
    tmp_path,
):
    run = build_run(dropout=0.0)
    manager = _manager(
        run,
        tmp_path,
        interval=100,
        async_mode="async",
        last_save_model_only=True,
        last_save_in_hf=True,
    )
    manager.hf_adapter = ToyAdapter(ToyArgs())
    train(run, 3, manager)
    manager.save(3, force=True)  # not due: a preemption notice
    # Committed at once (not left to a background write), with everything a resume needs.
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    record = read_commit(tmp_path / "step-3")
    assert record["model_only"] is False and {"optimizer", "rng", "dataloader"} <= set(
        record["states"]
    )
    assert not (tmp_path / "step-3" / "hf").exists()
    assert (
        checkpoint_keys(tmp_path / "step-3")["model.out.weight"].properties.dtype == torch.float32
    )
    manager.close()
    fresh = build_run(seed=5, dropout=0.0)
    assert _manager(fresh, tmp_path).load() == 3
    assert fresh.state.step == 3 and fresh.optimizer.state  # optimizer moments came back
