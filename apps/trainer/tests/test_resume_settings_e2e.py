"""A resume whose settings differ from the ones its checkpoint was saved with is stopped
before any process group, naming the setting, its two values and the fixes; healthy
checkpoints are never called unusable nor offered for deletion (issue 42, item 1)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from titan_ckpt import checkpoint_problems
from titan_trainer.cli import main as titan_train

DEBUG_TOML = Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *("--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump)),
        *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"),
        *("--metrics.enable_tensorboard", "false", "--metrics.save_plots_folder", ""),
        *("--checkpoint.enable", "--checkpoint.interval", "2"),
        *extra,
    ]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A debug run of 4 steps with seq_len 64, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("resume") / "run"
    assert titan_train(_args(dump, "--training.steps", "4")) == 0
    return dump


def _refused(args, capsys) -> str:
    code = titan_train(args)
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    assert "Traceback" not in out.err and "| loss" not in out.out
    return out.err


def _checkpoints_untouched(dump: Path) -> None:
    folder = dump / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]
    assert all(checkpoint_problems(p, read_data=True) == [] for p in folder.glob("step-*"))


def test_a_changed_seq_len_is_named_with_the_fixes_and_no_checkpoint_is_called_broken(
    saved_run, capsys
):
    err = _refused(_args(saved_run, "--training.steps", "6", "--training.seq_len", "128"), capsys)
    assert (
        f"titan: config error: the checkpoint this run resumes from ({saved_run}/checkpoint/"
        "step-4) was saved with [training] seq_len = 64 (this run: 128)"
    ) in err, err
    assert "resume with the saved value (--training.seq_len 64)" in err
    assert "--checkpoint.exclude_from_loading dataloader" in err
    assert "nothing is wrong with them" in err
    assert "not usable" not in err and "delete" not in err and "move the broken" not in err
    _checkpoints_untouched(saved_run)


def test_a_changed_flavor_is_named_with_the_fixes(saved_run, capsys):
    err = _refused(_args(saved_run, "--training.steps", "6", "--model.flavor", "100M"), capsys)
    assert "was saved with [model] flavor = 'debugmodel' (this run: '100M')" in err, err
    assert "its weights have other shapes than this run's model" in err
    assert "resume with the saved value (--model.flavor debugmodel)" in err
    assert "not usable" not in err and "delete" not in err
    _checkpoints_untouched(saved_run)


def test_a_changed_global_batch_size_is_named_in_samples(saved_run, capsys):
    # -1 there was local 2 x 1 data-parallel rank = 2 samples a step; 4 here.
    err = _refused(
        _args(saved_run, "--training.steps", "6", "--training.global_batch_size", "4"), capsys
    )
    assert "[training] global_batch_size = 2 (this run: 4)" in err, err
    _checkpoints_untouched(saved_run)


def test_the_offered_fix_of_starting_the_data_afresh_resumes_the_weights(
    saved_run, tmp_path, capsys
):
    dump = tmp_path / "run"
    shutil.copytree(saved_run, dump)
    code = titan_train(
        _args(
            dump,
            *("--training.steps", "5", "--training.seq_len", "128"),
            *("--checkpoint.exclude_from_loading", "dataloader"),
        )
    )
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "resumed at step 4" in out.out + out.err
    assert "step    5 | loss" in out.out + out.err
