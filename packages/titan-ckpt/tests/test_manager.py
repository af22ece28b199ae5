"""CheckpointManager in one process: exact resume, atomic folders, pruning, async commits,
model-only saves, what is and is not restored."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from ckpt_toy import ToyModel, assert_same, build_run, full_model, full_optimizer, train

from titan_ckpt import Checkpoint, CheckpointManager, list_checkpoints
from titan_ckpt.dcp_io import checkpoint_keys

N = 3


def _manager(run, folder, **cfg):
    return CheckpointManager(
        Checkpoint(enable=True, **cfg),
        run.states(),
        folder,
        config_toml='[job]\ndescription = "t"\n',
    )


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_after_stop_is_bitwise_identical_to_uninterrupted_run(tmp_path, async_mode):
    a = build_run()
    losses_a = train(a, 2 * N)
    b = build_run()
    manager = _manager(b, tmp_path, interval=N, async_mode=async_mode)
    # One step past the save: it runs while an async save may still be copying, and is then lost.
    losses_b = train(b, N + 1, manager)[:N]
    manager.close()
    c = build_run(seed=123)
    manager = _manager(c, tmp_path, interval=N, async_mode=async_mode)
    assert manager.load() == N
    losses_b += train(c, N, manager, last_step=2 * N)
    manager.close()
    assert losses_a == losses_b  # one process, same ops: bitwise
    assert_same(full_model(a.model), full_model(c.model), "parameters")
    assert_same(
        full_optimizer(a.model, a.optimizer), full_optimizer(c.model, c.optimizer), "optimizer"
    )
    assert (c.state.step, c.state.tokens_seen, c.data.position) == (
        a.state.step,
        a.state.tokens_seen,
        a.data.position,
    )


def test_resume_without_rng_state_diverges_so_the_rng_restore_matters(tmp_path):
    a = build_run()
    losses_a = train(a, 2 * N)
    b = build_run()
    manager = _manager(b, tmp_path, interval=N)
    train(b, N, manager)
    manager.close()
    c = build_run(seed=123)
    manager = _manager(c, tmp_path, interval=N, exclude_from_loading=["rng"])
    manager.load()
    assert train(c, N) != losses_a[N:]  # dropout masks differ without the saved generator state


def test_async_save_becomes_visible_only_when_committed(tmp_path):
    run = build_run()
    manager = _manager(run, tmp_path, interval=2, async_mode="async")
    train(run, 2, manager)
    # The write may be done, but only the training thread commits (on the next save or close).
    assert list_checkpoints(tmp_path) == []
    assert (tmp_path / "step-2.tmp").is_dir()
    train(run, 2, manager)  # the save at step 4 waits for and commits step 2 first
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert not (tmp_path / "step-4.tmp").exists()


def test_incomplete_leftovers_are_ignored_then_cleaned_up(tmp_path, caplog):
    run = build_run()
    manager = _manager(run, tmp_path, interval=2)
    train(run, 2, manager)
    manager.close()
    (tmp_path / "step-4.tmp").mkdir()
    (tmp_path / "step-4.tmp" / "__0_0.distcp").write_bytes(b"half a checkpoint")
    (tmp_path / "step-6").mkdir()  # a folder without the commit marker is no checkpoint
    fresh = build_run(seed=5)
    manager = _manager(fresh, tmp_path, interval=2)
    with caplog.at_level(logging.INFO, logger="titan"):
        assert manager.load() == 2
    assert "step-2" in caplog.text
    train(fresh, 2, manager)
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".titan.lock", "step-2", "step-4"]


def test_keep_latest_k_prunes_old_checkpoints_but_not_the_loaded_one(tmp_path):
    run = build_run()
    manager = _manager(run, tmp_path, interval=1, keep_latest_k=2)
    train(run, 5, manager)
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    again = build_run()
    manager = _manager(again, tmp_path, interval=1, keep_latest_k=1)
    assert manager.load(step=4) == 4
    train(again, 3, manager)  # saves 5 (replacing the old 5), 6, 7
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 7]


def test_load_of_a_missing_step_names_the_steps_there_are(tmp_path):
    run = build_run()
    manager = _manager(run, tmp_path, interval=2)
    train(run, 4, manager)
    with pytest.raises(FileNotFoundError, match=r"step 3 .*complete steps: 2, 4"):
        manager.load(step=3)
    assert _manager(build_run(), tmp_path / "empty").load() is None


def test_last_save_model_only_uses_export_dtype_and_resume_prefers_the_full_checkpoint(tmp_path):
    run = build_run()
    manager = _manager(
        run, tmp_path, interval=2, last_save_model_only=True, export_dtype="bfloat16"
    )
    train(run, 3, manager, last_step=3)
    manager.close()
    keys = checkpoint_keys(tmp_path / "step-3")
    assert {k.split(".")[0] for k in keys} == {"model"}
    assert keys["model.out.weight"].properties.dtype == torch.bfloat16
    fresh = build_run(seed=9)
    assert (
        _manager(fresh, tmp_path).load() == 2
    )  # step 3 cannot resume training: it has no optimizer


def test_excluded_states_keep_their_current_values(tmp_path):
    run = build_run()
    manager = _manager(run, tmp_path, interval=2)
    train(run, 2, manager)
    fresh = build_run(seed=1)
    before = full_model(fresh.model)
    _manager(fresh, tmp_path, exclude_from_loading=["model", "dataloader"]).load()
    assert_same(before, full_model(fresh.model), "excluded model")
    assert fresh.data.position == 0 and fresh.state.step == 2


def test_every_checkpoint_holds_the_resolved_config_and_a_commit_record(tmp_path):
    run = build_run()
    manager = _manager(run, tmp_path, interval=1)
    train(run, 1, manager)
    step = tmp_path / "step-1"
    assert (step / "config.toml").read_text() == '[job]\ndescription = "t"\n'
    assert "config.toml" in checkpoint_keys(step)  # also inside the DCP files
    record = json.loads((step / "titan_commit.json").read_text())
    assert record["step"] == 1 and record["world_size"] == 1 and "optimizer" in record["states"]
    keys = checkpoint_keys(step)
    assert {"rng.rank0", "dataloader.dp0", "train_state.state", "lr_scheduler.state"} <= keys.keys()


class ShapeShifter:
    """A state whose structure changes as it runs: empty containers and None at first."""

    def __init__(self):
        self.state = {"pending": {}, "last": None, "seen": []}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def test_states_whose_structure_changed_since_the_save_load_as_saved(tmp_path):
    saved = ShapeShifter()
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), {"extra": saved}, tmp_path)
    manager.save(1)
    later = ShapeShifter()
    later.state = {"pending": {"doc": [1, 2]}, "last": (3, 4), "seen": [5]}
    assert CheckpointManager(Checkpoint(), {"extra": later}, tmp_path).load() == 1
    assert later.state == {"pending": {}, "last": None, "seen": []}


def test_seed_checkpoint_is_model_only_step_0(tmp_path):
    run = build_run(seed=11)
    manager = _manager(run, tmp_path, create_seed_checkpoint=True)
    manager.save(0, last_step=True)
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0]
    assert {k.split(".")[0] for k in checkpoint_keys(tmp_path / "step-0")} == {"model"}
    fresh = build_run(seed=12)
    assert _manager(fresh, tmp_path).load() == 0
    assert_same(full_model(run.model), full_model(fresh.model), "seed weights")
    assert fresh.state.step == 0


def test_pipeline_stages_on_one_rank_save_names_of_the_whole_model(tmp_path):
    torch.manual_seed(0)
    first, second = ToyModel(dropout=0.0), ToyModel(dropout=0.0)
    del first.layers["1"]
    first.norm = first.out = None
    del second.layers["0"]
    second.embed = None
    parts = [first, second]
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=0.1)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.step()
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1), {"model": parts, "optimizer": optimizer}, tmp_path
    )
    manager.save(1)
    whole = ToyModel(dropout=0.0)
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=0.1)
    assert (
        CheckpointManager(Checkpoint(), {"model": whole, "optimizer": whole_opt}, tmp_path).load()
        == 1
    )
    expected = {**full_model(first), **full_model(second)}
    assert_same(expected, full_model(whole), "stages -> whole model")
    assert whole_opt.state[whole.out.weight]["exp_avg"].equal(
        optimizer.state[second.out.weight]["exp_avg"]
    )
    # and back: the whole model's checkpoint loads into the two stages
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1),
        {"model": whole, "optimizer": whole_opt},
        tmp_path / "w",
    )
    manager.save(1)
    assert (
        CheckpointManager(
            Checkpoint(), {"model": parts, "optimizer": optimizer}, tmp_path / "w"
        ).load()
        == 1
    )


class _GlobalPosition:
    """A loader state that is one position of the whole job (`GLOBAL_STATE`)."""

    state_is_global = True

    def __init__(self, inner):
        self.inner = inner

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


@pytest.mark.parametrize("is_global", [True, False])
def test_a_global_loader_state_is_stored_once_and_restored_on_another_data_parallel_degree(
    tmp_path, is_global
):
    run = build_run()
    states = run.states()
    if is_global:
        states["dataloader"] = _GlobalPosition(run.data)
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=2), states, tmp_path, dp_rank=0, dp_world_size=2
    )
    train(run, 2, manager)
    manager.close()
    keys = checkpoint_keys(tmp_path / "step-2")
    assert ("dataloader.state" in keys) == is_global and ("dataloader.dp0" in keys) != is_global
    fresh = build_run(seed=1)
    states = fresh.states()
    if is_global:
        states["dataloader"] = _GlobalPosition(fresh.data)
    # Resumed with 4 data-parallel ranks: a per-rank state does not fit, the global one does.
    CheckpointManager(Checkpoint(enable=True), states, tmp_path, dp_world_size=4).load()
    assert fresh.data.position == (run.data.position if is_global else 0)
    assert fresh.state.step == 2


def test_async_save_in_a_job_whose_process_group_has_no_cpu_backend(tmp_path):
    """A job that made its group with the GPU's backend alone (`nccl`, which serves no CPU
    tensors): DCP's async save refuses such a group ("A CPU backend must be enabled"), so the
    manager saves over a gloo group of its own. On CPU, `cuda:gloo` builds the same shape of
    group: gloo registered for the accelerator only, none for CPU tensors."""
    import torch.distributed as dist

    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        run = build_run()
        manager = _manager(run, tmp_path, interval=2, async_mode="async")
        train(run, 2, manager)  # step 2: an async save
        manager.close()  # waits for it and commits it
    finally:
        dist.destroy_process_group()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    resumed = build_run(seed=123)
    manager = _manager(resumed, tmp_path, interval=2)
    assert manager.load() == 2
    manager.close()
    assert_same(full_model(run.model), full_model(resumed.model), "parameters")


def test_async_saves_where_torchs_stager_stages_only_once(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes itself after its first stage (the second fails with
    `KeyError: <class 'type'>`); on such a torch every save gets a stager of its own
    (StagerPerSave). That path, taken here on any torch: three async saves, then an exact
    resume from the last."""
    from titan_ckpt import staging

    monkeypatch.setattr(staging, "default_stager_is_reusable", lambda: False)
    a = build_run()
    losses_a = train(a, 8)
    b = build_run()
    manager = _manager(b, tmp_path, interval=2, async_mode="async")
    assert isinstance(manager._stager._copier, staging.StagerPerSave)
    train(b, 6, manager)  # async saves at steps 2, 4 and 6
    manager.close()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    c = build_run(seed=123)
    manager = _manager(c, tmp_path, interval=2)
    assert manager.load() == 6
    assert train(c, 2) == losses_a[6:]  # one process, same ops: bitwise
    manager.close()
