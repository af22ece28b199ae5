"""What a plain run says is so (issue 42, item 16): the banner names the model and the data
in force (the TOML's description, which speaks of the TOML's data, goes when the command line
trains on other data), counts in the singular where there is one, and a single-process run
does not talk of collective timeouts, which have no peer to wait for."""

from __future__ import annotations

from pathlib import Path

from titan_trainer.cli import main as titan_train

DEBUG_TOML = Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"
DESCRIPTION = "Llama 3.1 debug model on the embedded Python docs corpus"


def _run(tmp_path: Path, capsys, *extra: str) -> str:
    code = titan_train(
        [
            *("--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(tmp_path / "run")),
            *("--training.seq_len", "64", "--training.local_batch_size", "2"),
            *("--training.steps", "2", "--metrics.enable_tensorboard", "false"),
            *("--metrics.save_plots_folder", "", "--training.mixed_precision_param", "float32"),
            *extra,
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    return out.out + out.err


def test_the_banner_says_what_trains_on_what_and_one_process_is_one(tmp_path, capsys):
    said = _run(tmp_path, capsys)
    (banner,) = [line for line in said.splitlines() if " on cpu | " in line]
    assert banner.endswith(
        f"INFO {DESCRIPTION} | llama3 debugmodel on pydocs | 1 process on cpu | single process"
        " | compute torch.float32"
    ), banner
    assert "collectives now time out" not in said  # one process: no peer to wait for
    assert "processes" not in banner and "groups)" not in said


def test_the_description_goes_when_the_command_line_trains_on_other_data(tmp_path, capsys):
    said = _run(tmp_path, capsys, "--training.dataset", "pydocs_validation")
    (banner,) = [line for line in said.splitlines() if " on cpu | " in line]
    assert "INFO llama3 debugmodel on pydocs_validation | 1 process on cpu" in banner, banner
    assert DESCRIPTION not in banner
