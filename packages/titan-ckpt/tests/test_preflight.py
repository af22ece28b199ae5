"""`check_loadable`: whether the checkpoint a run would resume from fits a model's tensors,
answered from its metadata alone."""

from __future__ import annotations

import torch
from ckpt_toy import ToyModel

from titan_ckpt import Checkpoint, CheckpointManager, check_loadable


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_a_matching_model_loads_and_another_shape_or_name_is_named(tmp_path):
    config = Checkpoint(enable=True, folder="checkpoint", interval=1)
    model = ToyModel(dropout=0.0)
    manager = CheckpointManager(config, {"model": model}, tmp_path / "checkpoint")
    manager.save(3, last_step=True)
    manager.close()

    problems, note = check_loadable(config, str(tmp_path), _shapes(model))
    assert problems == [] and "step-3 (step 3), which loads into this layout" in note, note

    wider = _shapes(ToyModel(dim=48))
    problems, note = check_loadable(config, str(tmp_path), wider)
    assert "does NOT load" in note and len(problems) == 1, problems
    assert (
        "has other shapes than this model: embed.weight (64, 32) in the checkpoint, (64, 48) in this model"
        in problems[0]
    )

    deeper = _shapes(ToyModel(n_layers=3))
    problems, _ = check_loadable(config, str(tmp_path), deeper)
    assert "lacks 4 tensor(s) of this model: layers.2.w1.weight" in problems[0], problems


def test_no_checkpoint_is_a_note_and_a_bad_initial_load_path_a_problem(tmp_path):
    config = Checkpoint(enable=True, folder="checkpoint")
    problems, note = check_loadable(config, str(tmp_path), {"w": (2, 2)})
    assert problems == [] and "none in" in note and "starts from its initialisation" in note
    config = Checkpoint(enable=True, folder="checkpoint", initial_load_path=str(tmp_path / "nope"))
    problems, _ = check_loadable(config, str(tmp_path), {"w": (2, 2)})
    assert "is not a complete checkpoint folder" in problems[0]
