"""A checkpoint damaged after its commit is found before anything is loaded, reported by name
with the reason, and the previous complete checkpoint is used; `titan-ckpt verify` finds the
same offline. One case per corruption seen in practice."""

from __future__ import annotations

import logging
import re

import corrupt
import pytest
import torch
from ckpt_toy import ToyData, assert_same, build_run, full_model, train
from conftest import ckpt_manager as _manager

from titan_ckpt import CheckpointLoadError, checkpoint_problems
from titan_ckpt.cli import main as titan_ckpt
from titan_core import StateMismatchError


def _step4_data(folder):
    return corrupt.data_file(folder / "step-4")


CORRUPTIONS = {
    "truncated_distcp": (
        lambda f: corrupt.truncate(_step4_data(f)),
        r"__0_0\.distcp has [\d,]+ bytes, [\d,]+ when saved \(truncated\)",
    ),
    "garbage_distcp": (
        lambda f: corrupt.fill_with_garbage(_step4_data(f)),
        r"__0_0\.distcp does not match its xxh3_128 checksum",
    ),
    "value_overwritten_in_place": (
        lambda f: corrupt.overwrite_value(f / "step-4", "model.embed.weight", 1e30),
        r"__0_0\.distcp does not match its xxh3_128 checksum",
    ),
    "missing_metadata": (
        lambda f: (f / "step-4" / ".metadata").unlink(),
        r"it has no \.metadata",
    ),
    "unreadable_commit_marker": (
        lambda f: corrupt.break_commit(f / "step-4"),
        r"its commit marker titan_commit\.json cannot be read",
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_is_loaded(
    folder, saved, kind, caplog
):
    damage, reason = CORRUPTIONS[kind]
    damage(folder)
    assert checkpoint_problems(folder / "step-2") == []
    (problem,) = checkpoint_problems(folder / "step-4")
    assert re.search(reason, problem), problem

    run = build_run(seed=9)
    with caplog.at_level(logging.INFO, logger="titan"):
        assert _manager(run, folder).load() == 2
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and r.name.startswith("titan")
    ]
    assert len(errors) == 1 and "step-4 is not usable" in errors[0], errors
    assert re.search(reason, errors[0])
    assert "resumed from step-2 instead of the newest checkpoint" in caplog.text
    assert_same(saved[1], full_model(run.model), "the model after falling back to step 2")


def test_the_value_overwritten_in_place_would_load_silently_without_the_checksum(folder):
    # The reason for the checksums: the file is still valid, only a number changed.
    corrupt.overwrite_value(folder / "step-4", "model.embed.weight", 1e30)
    corrupt.drop_checksums(folder / "step-4")
    run = build_run(seed=9)
    assert _manager(run, folder).load() == 4
    assert run.model.embed.weight.view(-1)[0].item() == torch.tensor(1e30).item()  # float32 1e30


def test_an_unreadable_marker_in_an_older_checkpoint_does_not_block_the_newer_one(folder):
    corrupt.break_commit(folder / "step-2")
    run = build_run(seed=9)
    assert _manager(run, folder).load() == 4


def test_after_falling_back_the_run_saves_again_and_replaces_the_corrupt_checkpoint(folder):
    corrupt.fill_with_garbage(_step4_data(folder))
    run = build_run(seed=9)
    manager = _manager(run, folder, keep_latest_k=1)
    assert manager.load() == 2
    run.state.step = 2
    train(run, 1, manager)  # nothing due at step 3
    train(run, 1, manager)  # step 4 is saved over the corrupt one
    manager.close()
    assert checkpoint_problems(folder / "step-4") == []
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]


def test_when_every_checkpoint_fails_the_error_lists_each_and_nothing_is_loaded(folder):
    corrupt.truncate(_step4_data(folder))
    corrupt.fill_with_garbage(corrupt.data_file(folder / "step-2"))
    with pytest.raises(CheckpointLoadError) as info:
        _manager(build_run(seed=9), folder).load()
    message = str(info.value)
    assert (
        "step-4: __0_0.distcp has" in message and "step-2: __0_0.distcp does not match" in message
    )
    assert "move the broken ones away" in message


def test_a_corrupt_checkpoint_asked_for_by_step_is_not_replaced_by_another(folder):
    corrupt.truncate(_step4_data(folder))
    with pytest.raises(CheckpointLoadError, match=r"step-4: __0_0\.distcp has"):
        _manager(build_run(seed=9), folder).load(step=4)


def test_verify_command_reports_each_corrupt_checkpoint_and_fails(folder, capsys):
    assert titan_ckpt(["verify", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "step-2: OK (" in out and "step-4: OK (" in out and "checksums" in out
    corrupt.overwrite_value(folder / "step-4", "model.embed.weight", 1e30)
    assert titan_ckpt(["verify", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "step-4: FAILED: __0_0.distcp does not match its xxh3_128 checksum" in captured.out
    assert "step-2: OK" in captured.out and "1 of 2 checkpoints failed" in captured.err
    assert titan_ckpt(["verify", str(folder / "step-2")]) == 0  # one checkpoint by its path


def test_verify_values_finds_nan_in_a_checkpoint_without_checksums(folder, capsys):
    corrupt.overwrite_value(folder / "step-4", "model.embed.weight", float("nan"))
    corrupt.drop_checksums(folder / "step-4")
    assert titan_ckpt(["verify", str(folder / "step-4")]) == 0
    assert "not verified: it records no checksums" in capsys.readouterr().out
    assert titan_ckpt(["verify", "--values", str(folder / "step-4")]) == 1
    assert "FAILED: model.embed.weight holds NaN or inf" in capsys.readouterr().out


def test_a_checkpoint_without_checksums_holding_nan_is_not_resumed(folder, caplog):
    corrupt.overwrite_value(folder / "step-4", "model.embed.weight", float("nan"))
    corrupt.drop_checksums(folder / "step-4")
    run = build_run(seed=9)
    with caplog.at_level(logging.INFO, logger="titan"):
        assert _manager(run, folder).load() == 2
    assert "step-4 is not usable: it holds NaN or inf in model.embed.weight" in caplog.text
    assert torch.isfinite(run.model.embed.weight).all()


class _SeededData(ToyData):
    """ToyData that, like a real loader, refuses a position counted in another seed's order."""

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise StateMismatchError(
                f"saved with seed {state['seed']} (this loader: {self.seed}): resume with it"
            )
        super().load_state_dict(state)


def test_a_state_saved_under_other_settings_stops_the_load_without_calling_checkpoints_broken(
    folder, caplog
):
    run = build_run(seed=9)
    run.data = _SeededData(seed=5)  # the checkpoints' loader had seed 7
    with caplog.at_level(logging.INFO, logger="titan"), pytest.raises(CheckpointLoadError) as info:
        _manager(run, folder).load()
    message = str(info.value)
    assert message.startswith(f"checkpoint {folder / 'step-4'} does not fit this run: saved with")
    assert "seed 7 (this loader: 5): resume with it" in message
    assert "nothing is wrong with the checkpoints" in message and "move" not in message
    # step-2 was saved the same way: it is not tried, and nothing is called unusable.
    assert "not usable" not in caplog.text and "step-2" not in caplog.text
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]
