"""Fixtures shared by titan-ckpt's tests: one toy run's checkpoints, saved once for every test
that damages a copy of them (test_corruption.py, test_marker_holes.py)."""

from __future__ import annotations

import shutil

import pytest
from ckpt_toy import build_run, full_model, train

from titan_ckpt import Checkpoint, CheckpointManager


def ckpt_manager(run, folder, **cfg) -> CheckpointManager:
    """A manager saving `run`'s states to `folder` every 2 steps, with `cfg` on top."""
    return CheckpointManager(Checkpoint(enable=True, interval=2, **cfg), run.states(), folder)


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """step-2 and step-4 of a toy run, and the model as it was at step 2. Tests read them
    through `folder`, a copy of their own."""
    folder = tmp_path_factory.mktemp("saved")
    run = build_run()
    manager = ckpt_manager(run, folder)
    train(run, 2, manager)
    at_2 = full_model(run.model)
    train(run, 2, manager)
    manager.close()
    return folder, at_2


@pytest.fixture
def folder(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[0], copy)
    return copy
