"""`check_loadable`: whether the checkpoint a run would resume from fits a model's tensors,
answered from its metadata alone."""

from __future__ import annotations

import re

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


def test_check_space_counts_the_checkpoints_kept_at_once_against_the_free_space(tmp_path):
    import shutil  # noqa: PLC0415

    from titan_ckpt import check_space  # noqa: PLC0415

    free = shutil.disk_usage(tmp_path).free
    config = Checkpoint(enable=True, folder="checkpoint", interval=2, keep_latest_k=2)
    # 5 saves to step 10, at most 3 on disk at once (2 kept + 1 being written): 1.5x the
    # free space does not fit; 0.3x does.
    problems, note = check_space(config, str(tmp_path), free // 2, steps=10)
    assert (
        len(problems) == 1
        and "this run saves 5 (keep_latest_k = 2 keeps 2, plus the one" in (problems[0])
    )
    assert (
        "will not fit on the disk of" in problems[0]
        and "lower [checkpoint] keep_latest_k" in (problems[0])
    )
    problems, note = check_space(config, str(tmp_path), free // 10, steps=10)
    assert problems == [] and "5 to save" in note
    assert re.search(r"needs up to [\d.,]+ [KMGT]iB more .* [\d.,]+ [KMGT]iB free there", note)
    # Checkpoints already there take their space now and free it when pruned: resuming from
    # step 4 with two of them, the run keeps step 4 (the one it resumed from), the newest two
    # and the one being written at its last save: two more than there are now.
    manager = CheckpointManager(config, {"model": ToyModel(dropout=0.0)}, tmp_path / "checkpoint")
    manager.save(2, force=True)
    manager.save(4, force=True)
    manager.close()
    problems, note = check_space(config, str(tmp_path), free // 3, steps=10)
    assert problems == [] and "3 to save" in note, (problems, note)
    assert "plus step-4, which this run resumes from and keeps" in note
    # Every checkpoint kept: all of them.
    config.keep_latest_k = 0
    problems, _ = check_space(config, str(tmp_path), free // 2, steps=10)
    assert "this run saves 3 (keep_latest_k = 0 keeps every one)" in problems[0]


def test_check_space_counts_the_checkpoint_a_run_resumes_from_which_it_never_prunes(tmp_path):
    # The run: resumed from step 2 with keep_latest_k = 1, it saves steps 4 and 6;
    # step 2 stays (a point to resume from again), so step 6 is written beside 2 and 4.
    from ckpt_toy import build_run, train  # noqa: PLC0415

    from titan_ckpt import check_space  # noqa: PLC0415
    from titan_ckpt.layout import checkpoint_bytes  # noqa: PLC0415
    from titan_ckpt.preflight import size_text  # noqa: PLC0415

    config = Checkpoint(enable=True, folder="checkpoint", interval=2, keep_latest_k=1)
    run = build_run()
    manager = CheckpointManager(config, run.states(), tmp_path / "checkpoint")
    train(run, 2, manager)
    manager.close()
    size = checkpoint_bytes(tmp_path / "checkpoint" / "step-2")
    _, note = check_space(config, str(tmp_path), 1, steps=6)
    assert note.startswith(
        f"checkpoint: about {size_text(size)} each, 2 to save; {tmp_path / 'checkpoint'} needs"
        f" up to {size_text(2 * size)} more (keep_latest_k = 1 keeps 1, plus the one being"
        " written, plus step-2, which this run resumes from and keeps)"
    ), note
    # And so it goes: the resumed run ends with three checkpoints on disk at its last save.
    resumed = build_run()
    manager = CheckpointManager(config, resumed.states(), tmp_path / "checkpoint")
    assert manager.load() == 2
    resumed.state.step = 2
    train(resumed, 4, manager)
    manager.close()
    assert sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*")) == ["step-2", "step-6"]


def test_check_space_counts_each_checkpoint_as_large_as_the_newest_one_there(tmp_path):
    # The shapes' count leaves out DCP's metadata and framing and the small states; the
    # newest checkpoint there is what the next save writes, and what a failed save reports.
    import shutil  # noqa: PLC0415

    from titan_ckpt import check_space  # noqa: PLC0415
    from titan_ckpt.layout import checkpoint_bytes  # noqa: PLC0415
    from titan_ckpt.preflight import size_text  # noqa: PLC0415

    config = Checkpoint(enable=True, folder="checkpoint", interval=2, keep_latest_k=1)
    model = ToyModel(dropout=0.0)
    manager = CheckpointManager(config, {"model": model}, tmp_path / "checkpoint")
    manager.save(2, force=True)
    manager.close()
    real = checkpoint_bytes(tmp_path / "checkpoint" / "step-2")
    counted = sum(p.numel() * p.element_size() for p in model.parameters())
    assert real > counted
    _, note = check_space(config, str(tmp_path), counted, steps=6)
    assert note.startswith(f"checkpoint: about {size_text(real)} each, 2 to save;"), note
    free = shutil.disk_usage(tmp_path).free
    problems, _ = check_space(config, str(tmp_path), free + 1, steps=6)
    assert "(model and optimizer state)" in problems[0]  # the count is larger: it is used
