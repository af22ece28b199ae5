"""A checkpoint never runs code and never holds NaN or inf: planted files are refused with a
clear message (and nothing runs), and a state with a non-finite value is never saved."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle

import corrupt
import pytest
import torch
from ckpt_toy import build_run, train

from titan_ckpt import (
    Checkpoint,
    CheckpointManager,
    CheckpointSaveError,
    UnsafeCheckpointError,
    checkpoint_problems,
    list_checkpoints,
)
from titan_ckpt.cli import main as titan_ckpt
from titan_ckpt.dcp_io import checkpoint_keys
from titan_ckpt.errors import first_line
from titan_ckpt.integrity import nonfinite_entries


def _manager(states, folder, **cfg):
    return CheckpointManager(Checkpoint(enable=True, interval=2, **cfg), states, folder)


@pytest.fixture
def folder(tmp_path):
    run = build_run()
    manager = _manager(run.states(), tmp_path / "ckpt")
    train(run, 4, manager)
    manager.close()
    return tmp_path / "ckpt"


def _assert_refused_without_running(message: str, marker) -> None:
    assert not marker.exists(), "the planted code ran"
    assert "posix.system" in message or "os.system" in message, message
    assert "never runs code" in message
    assert "weights_only=False" not in message and "`weights_only` set to `False`" not in message


@pytest.mark.parametrize("checksum", ["recomputed", "absent"])
def test_a_planted_metadata_file_is_refused_and_the_previous_checkpoint_is_loaded(
    folder, tmp_path, checksum, caplog
):
    marker = tmp_path / "ran"
    corrupt.plant_metadata(folder / "step-4", f"touch {marker}")
    if checksum == "recomputed":  # whoever planted it also rewrote the marker's checksum
        corrupt.rechecksum(folder / "step-4", ".metadata")
    else:  # a marker from before checksums: only the restricted unpickler stands in the way
        corrupt.drop_checksums(folder / "step-4")
    run = build_run(seed=3)
    with caplog.at_level(logging.INFO, logger="titan"):
        assert _manager(run.states(), folder).load() == 2
    (error,) = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and r.name.startswith("titan")
    ]
    assert "step-4 is not usable: refused to read" in error and ".metadata" in error
    _assert_refused_without_running(error, marker)

    # Every other way in refuses it too.
    with pytest.raises(UnsafeCheckpointError) as info:
        checkpoint_keys(folder / "step-4")
    _assert_refused_without_running(str(info.value), marker)
    assert titan_ckpt(["verify", str(folder / "step-4")]) == 1
    assert (
        titan_ckpt(["convert", "dcp-to-torch", str(folder / "step-4"), str(tmp_path / "x.pt")]) == 2
    )
    assert not marker.exists()


def test_a_state_that_would_run_code_is_refused_without_advice_to_load_it_unsafely(
    tmp_path, caplog
):
    # torch.save pickles anything, so a state can smuggle an object into the .distcp file;
    # the commit's checksums then match, and only the weights_only reader stands in the way.
    marker = tmp_path / "ran"
    run = build_run()
    good = _manager(run.states(), tmp_path / "ckpt")
    train(run, 2, good)
    good.close()
    states = {**run.states(), "extra": corrupt.Payload(f"touch {marker}")}
    bad = _manager(states, tmp_path / "ckpt")
    train(run, 2, bad)
    bad.close()
    assert checkpoint_problems(tmp_path / "ckpt" / "step-4") == []

    fresh = build_run(seed=4)
    states = {**fresh.states(), "extra": corrupt.Payload("true")}
    with caplog.at_level(logging.INFO, logger="titan"):
        assert _manager(states, tmp_path / "ckpt").load() == 2
    (error,) = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and r.name.startswith("titan")
    ]
    assert "step-4 is not usable: reading it failed" in error
    assert "refused to load the saved state 'state'" in error
    _assert_refused_without_running(error, marker)


def test_non_finite_weights_are_never_saved(tmp_path):
    run = build_run()
    manager = _manager(run.states(), tmp_path)
    train(run, 2, manager)
    with torch.no_grad():
        run.model.layers["0"].w1.weight[0, 0] = float("nan")
        run.model.out.weight[1, 1] = float("inf")
    with pytest.raises(CheckpointSaveError) as info:
        manager.save(4)
    message = str(info.value)
    assert message.startswith(
        "checkpoint step 4 not saved: model.layers.0.w1.weight, model.out.weight"
    )
    assert (
        "hold NaN or inf" in message
        and "the previous checkpoint step-2 stays the newest" in message
    )
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    assert not (tmp_path / "step-4.tmp").exists()
    manager.close()


def test_non_finite_optimizer_state_is_never_saved_and_a_model_only_save_checks_the_weights(
    tmp_path,
):
    run = build_run()
    manager = _manager(run.states(), tmp_path, last_save_model_only=True)
    train(run, 1, manager)
    state = run.optimizer.state[run.model.embed.weight]
    state["exp_avg_sq"][0, 0] = float("inf")
    with pytest.raises(CheckpointSaveError, match=r"optimizer\.state\.embed\.weight\.exp_avg_sq"):
        manager.save(2)
    state["exp_avg_sq"][0, 0] = 0.0
    with torch.no_grad():
        run.model.norm.weight[0] = float("nan")
    with pytest.raises(CheckpointSaveError, match=r"model\.norm\.weight hold NaN or inf"):
        manager.save(3, last_step=True)  # the model-only export checks the live weights
    assert list_checkpoints(tmp_path) == []
    manager.close()


def test_the_commit_marker_records_every_file_and_that_values_were_checked(folder):
    record = json.loads((folder / "step-4" / "titan_commit.json").read_text())
    assert record["finite"] is True
    assert set(record["files"]) == {"__0_0.distcp", ".metadata"}
    for name, entry in record["files"].items():
        size = (folder / "step-4" / name).stat().st_size
        assert entry["algorithm"] == "xxh3_128" and entry["bytes"] == size > 0
        # Pieces tile the file from its first byte to its last, each with a 128-bit sum.
        ends = [start + length for start, length, _ in entry["pieces"]]
        assert [start for start, _, _ in entry["pieces"]] == [0, *ends[:-1]] and ends[-1] == size
        assert all(len(digest) == 32 for _, _, digest in entry["pieces"])
    assert not list(folder.glob("step-4/*.sum.json"))  # the ranks' side files are merged away


def test_the_nonfinite_scan_is_exact_for_huge_finite_values_and_every_dtype():
    huge = torch.full((8,), 3e38)  # finite, but its 2-norm overflows: checked element-wise
    state = {
        "huge": huge,
        "bf16": torch.ones(4, dtype=torch.bfloat16),
        "ints": torch.arange(3),
        "lr": 1e-3,
        "nested": {"nan": torch.tensor([1.0, float("nan")]), "inf": float("inf")},
        "half": torch.tensor([float("-inf")], dtype=torch.float16),
        "empty": torch.empty(0),
    }
    assert sorted(nonfinite_entries(state, "opt")) == [
        "opt.half",
        "opt.nested.inf",
        "opt.nested.nan",
    ]


def test_torchs_weights_only_refusal_is_reported_without_its_advice_to_load_unsafely():
    class RunsCode:
        def __reduce__(self):
            return (os.system, ("true",))

    buffer = io.BytesIO()
    torch.save({"t": RunsCode()}, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError) as info:
        torch.load(buffer, weights_only=True)  # what DCP's reader does with every tensor
    assert "weights_only` set to `False`" in str(info.value)  # torch's own advice...
    line = first_line(info.value)
    assert line.startswith("refused to load a saved tensor: ") and "posix.system" in line
    assert "False" not in line and "never runs code" in line  # ...is not passed on
