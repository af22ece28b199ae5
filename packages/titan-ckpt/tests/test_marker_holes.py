"""What the commit marker and the folder say must be what is checked: a marker that lists no
checksum for a file, a marker that names another step, a `step-<N>` whose marker is gone, a
corrupt checkpoint asked for by step, and values no optimizer can produce are each reported by
name with the fix, never passed over in silence."""

from __future__ import annotations

import hashlib
import json
import logging

import corrupt
import pytest
from ckpt_toy import assert_same, build_run, full_model, train
from conftest import ckpt_manager as _manager

from titan_ckpt import CheckpointLoadError, checkpoint_problems
from titan_ckpt.cli import main as titan_ckpt
from titan_core import CheckpointError

COMMIT = "titan_commit.json"


def _edit_marker(step_dir, change) -> None:
    record = json.loads((step_dir / COMMIT).read_text())
    change(record)
    (step_dir / COMMIT).write_text(json.dumps(record))


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def _load(folder, caplog, **kwargs):
    run = build_run(seed=9)
    with caplog.at_level(logging.INFO, logger="titan"):
        step = _manager(run, folder).load(**kwargs)
    return step, run


@pytest.mark.parametrize("listed", ["nothing", "only .metadata"])
def test_a_marker_without_the_checksum_of_a_data_file_is_refused_not_trusted(
    folder, saved, caplog, capsys, listed
):
    step_4 = folder / "step-4"
    keep = {} if listed == "nothing" else {".metadata"}
    _edit_marker(
        step_4, lambda r: r.update(files={k: v for k, v in r["files"].items() if k in keep})
    )
    _flip_a_byte(corrupt.data_file(step_4))  # which nothing would then catch
    step, run = _load(folder, caplog)
    assert step == 2
    (error,) = _errors(caplog)
    assert "step-4 is not usable: its commit marker records no checksum for " in error, error
    assert "__0_0.distcp" in error or ".metadata" in error
    assert "cannot be verified" in error and "move the folder away" in error
    assert_same(saved[1], full_model(run.model), "the model after falling back to step 2")
    assert titan_ckpt(["verify", str(step_4)]) == 1
    assert "FAILED: its commit marker records no checksum for" in capsys.readouterr().out


def test_a_marker_that_names_another_step_than_its_folder_is_refused(folder, caplog, capsys):
    _edit_marker(folder / "step-4", lambda r: r.update(step=6))
    step, run = _load(folder, caplog)
    assert step == 2 and run.state.step == 2  # never "step 6" from a folder named step-4
    (error,) = _errors(caplog)
    assert "step-4 is not usable: its commit marker says step 6, but its folder is step-4" in error
    assert titan_ckpt(["verify", str(folder)]) == 1
    assert "step-4: FAILED: its commit marker says step 6" in capsys.readouterr().out


def test_a_step_folder_whose_marker_was_deleted_is_named_and_kept(folder, caplog, capsys):
    (folder / "step-4" / COMMIT).unlink()
    (folder / "step-6.tmp").mkdir()  # an unfinished save: ignored without a word
    step, run = _load(folder, caplog)
    assert step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (warning,) = [w for w in warnings if "step-4" in w]
    assert "is not loaded: it holds .metadata but no commit marker titan_commit.json" in warning
    assert "restore its marker from a copy; otherwise move it away" in warning
    assert not any("step-6" in w for w in warnings)
    # Saving again (step 3 is not due; the manager saves step 4 only when the run gets there)
    # removes the unfinished save but never the folder that lost its marker.
    manager = _manager(run, folder)
    run.state.step = 2
    train(run, 1, manager)
    manager.save(3, force=True)
    manager.close()
    assert (folder / "step-4" / ".metadata").is_file() and not (folder / "step-6.tmp").exists()
    assert titan_ckpt(["verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "step-4: FAILED: it holds .metadata but no commit marker" in out
    assert titan_ckpt(["list", str(folder)]) == 0
    assert "step-4: not a checkpoint (titan_commit.json is missing)" in capsys.readouterr().out


def test_a_corrupt_checkpoint_asked_for_by_step_names_its_problem_and_the_usable_one(folder):
    corrupt.truncate(corrupt.data_file(folder / "step-4"))
    with pytest.raises(CheckpointLoadError) as info:
        _manager(build_run(seed=9), folder).load(step=4)
    message = str(info.value)
    assert message.startswith(
        f"the checkpoint asked for with [checkpoint] load_step = 4 in {folder} is not usable:\n"
        "  step-4: __0_0.distcp has "
    ), message
    assert message.splitlines()[-1] == (
        "step-2 passes every check (all its bytes against their checksums): resume from it with"
        " [checkpoint] load_step = 2 (--checkpoint.load_step 2), or -1 for the newest usable"
        " checkpoint"
    )
    assert isinstance(info.value, CheckpointError)  # what the trainer prints without a traceback
    with pytest.raises(CheckpointLoadError, match=r"complete steps: 2, 4\), asked for with"):
        _manager(build_run(seed=9), folder).load(step=6)


def test_when_every_checkpoint_fails_the_message_lists_each_with_the_fix(folder):
    corrupt.truncate(corrupt.data_file(folder / "step-4"))
    _edit_marker(folder / "step-2", lambda r: r.update(step=3))
    with pytest.raises(CheckpointError) as info:
        _manager(build_run(seed=9), folder).load()
    assert str(info.value).splitlines() == [
        f"no usable checkpoint in {folder}; each was left in place:",
        "  step-4: __0_0.distcp has 266,214 bytes, 532,429 when saved (truncated)",
        "  step-2: its commit marker says step 3, but its folder is step-2: the marker belongs to"
        " another checkpoint (copied or edited), so which step this is cannot be known; move the"
        " folder away",
        "move the broken ones away (or delete them) to resume from an older one, or to start"
        f" afresh; `titan-ckpt verify {folder}` checks them again",
    ]


def test_a_checkpoint_with_sha256_checksums_of_an_earlier_version_is_verified_with_them(
    folder, caplog
):
    # titan-ckpt's first checksummed markers: one SHA-256 per file.
    def to_sha256(record):
        for name in record["files"]:
            data = (folder / "step-4" / name).read_bytes()
            record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    _edit_marker(folder / "step-4", to_sha256)
    assert checkpoint_problems(folder / "step-4") == []
    step, _ = _load(folder, caplog)
    assert step == 4
    _flip_a_byte(corrupt.data_file(folder / "step-4"))
    (problem,) = checkpoint_problems(folder / "step-4")
    assert problem.startswith("__0_0.distcp does not match its sha256 checksum"), problem
    caplog.clear()
    step, _ = _load(folder, caplog)
    assert step == 2 and "does not match its sha256 checksum" in _errors(caplog)[0]


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (
            "optimizer.state.embed.weight.exp_avg_sq",
            -0.5,
            "optimizer.state.embed.weight.exp_avg_sq holds negative values (down to -0.5),"
            " which a second-moment estimate never does",
        ),
        (
            "optimizer.state.embed.weight.step",
            1000.0,
            "optimizer.state.embed.weight.step = 1,000 counts more optimizer steps than the"
            " checkpoint's step 4",
        ),
        (
            "optimizer.state.norm.weight.step",
            2.5,
            "optimizer.state.norm.weight.step = 2.5 is not a whole number of steps",
        ),
    ],
    ids=["negative_second_moment", "more_steps_than_the_run", "fractional_step"],
)
def test_verify_values_finds_a_finite_value_no_optimizer_produces(
    folder, capsys, key, value, reason
):
    # Forged with the checksums recomputed: the files match their marker, only the value is wrong.
    corrupt.overwrite_value(folder / "step-4", key, value)
    corrupt.rechecksum(folder / "step-4", corrupt.data_file(folder / "step-4").name)
    assert titan_ckpt(["verify", str(folder / "step-4")]) == 0
    capsys.readouterr()
    assert titan_ckpt(["verify", "--values", str(folder / "step-4")]) == 1
    out = capsys.readouterr().out
    assert f"step-4: FAILED: {reason}" in out, out
    assert titan_ckpt(["verify", "--values", str(folder / "step-2")]) == 0
    assert "OK (" in capsys.readouterr().out
