"""Hugging Face snapshots on a schedule (`hf_interval`): where they go, that an unfinished one
never looks complete, retention, the background write, and resuming from one with its
training state (`hf_save_optimizer`)."""

from __future__ import annotations

import pytest
from ckpt_toy import assert_same, build_run, full_model, full_optimizer, train
from ckpt_toy_hf import SlicedToyAdapter, ToyAdapter, ToyArgs

from titan_ckpt import Checkpoint, CheckpointManager, import_hf
from titan_ckpt.errors import CheckpointNotFoundError
from titan_ckpt.hf_snapshots import list_snapshots


def _tokenizer_files(folder):
    (folder / "tokenizer.json").write_text("{}")


def _run_with_snapshots(folder, steps=6, **config):
    run = build_run(dropout=0.0)
    cfg = Checkpoint(enable=True, interval=100, hf_interval=2, **config)
    manager = CheckpointManager(
        cfg,
        run.states(),
        folder,
        hf_adapter=SlicedToyAdapter(ToyArgs()),
        hf_extra_files=_tokenizer_files,
    )
    losses = train(run, steps, manager, last_step=steps)
    manager.close()
    return run, losses


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_snapshots_every_interval_kept_newest_and_written_as_the_weights_were(tmp_path, async_mode):
    # A crashed attempt at a snapshot: never listed, removed after the next one.
    (tmp_path / "hf" / "step-2.tmp").mkdir(parents=True)
    run, _ = _run_with_snapshots(tmp_path, steps=5, hf_keep_latest_k=2, async_mode=async_mode)
    assert [step for step, _ in list_snapshots(tmp_path)] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-4", "step-5"]
    snapshot = tmp_path / "hf" / "step-5"
    assert (snapshot / "tokenizer.json").is_file() and (snapshot / "config.json").is_file()
    back = import_hf(snapshot, ToyAdapter(ToyArgs()), progress=False)
    assert_same(full_model(run.model), back, f"snapshot ({async_mode})")
    # Step 4's snapshot holds step 4's weights, not those the run went on to (staged copies).
    again, _ = _run_with_snapshots(tmp_path / "again", steps=4)
    back = import_hf(tmp_path / "hf" / "step-4", ToyAdapter(ToyArgs()), progress=False)
    assert_same(full_model(again.model), back, f"step 4 ({async_mode})")


def test_a_run_started_from_a_snapshot_with_its_state_continues_as_the_run_did(tmp_path):
    whole, losses = _run_with_snapshots(tmp_path / "a", steps=6, hf_save_optimizer=True)
    assert (tmp_path / "a" / "hf" / "step-4" / "titan_state" / "titan_commit.json").is_file()

    run = build_run(seed=5, dropout=0.0)
    cfg = Checkpoint(
        enable=True,
        initial_load_path=str(tmp_path / "a" / "hf" / "step-4"),
        initial_load_in_hf=True,
        initial_load_model_only=False,
    )
    manager = CheckpointManager(
        cfg, run.states(), tmp_path / "b", hf_adapter=SlicedToyAdapter(ToyArgs())
    )
    assert manager.load() == 4
    assert run.state.step == 4
    assert train(run, 2) == losses[4:]
    manager.close()
    assert_same(full_model(whole.model), full_model(run.model), "weights after resuming")
    assert_same(
        full_optimizer(whole.model, whole.optimizer),
        full_optimizer(run.model, run.optimizer),
        "optimizer after resuming",
    )


def test_resuming_needs_the_training_state_beside_the_weights(tmp_path):
    _run_with_snapshots(tmp_path / "a", steps=2)
    run = build_run()
    cfg = Checkpoint(
        enable=True,
        initial_load_path=str(tmp_path / "a" / "hf" / "step-2"),
        initial_load_in_hf=True,
        initial_load_model_only=False,
    )
    manager = CheckpointManager(
        cfg, run.states(), tmp_path / "b", hf_adapter=SlicedToyAdapter(ToyArgs())
    )
    with pytest.raises(CheckpointNotFoundError, match="hf_save_optimizer = true"):
        manager.load()
    manager.close()


def test_bad_snapshot_settings():
    assert (
        Checkpoint(enable=True, hf_interval=-1)
        .validate()[0]
        .startswith("[checkpoint] hf_interval = -1 is not valid")
    )
    assert (
        Checkpoint(enable=True, hf_keep_latest_k=-1)
        .validate()[0]
        .startswith("[checkpoint] hf_keep_latest_k = -1 is not valid")
    )
    assert (
        "hf_interval = 0 writes none"
        in Checkpoint(enable=True, hf_save_optimizer=True).validate()[0]
    )
    assert "enable = false saves nothing" in Checkpoint(hf_interval=2).validate()[0]
