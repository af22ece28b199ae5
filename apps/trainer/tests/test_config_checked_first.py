"""The command line and the TOML are read and checked before torch is imported, so a config
error is said in a fraction of a second instead of after torch's and every plugin's imports
(issue 42, item 9: 6.7 s with cached bytecode, 12-16 s without, on the issue's 2-core
machine, 0.15 s now); and every command answers `--version` (issue 42, item 9). Each runs in
a fresh interpreter, where `sys.modules` tells what was imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[1]


def _fresh(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_config_errors_and_help_are_said_without_importing_torch(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("[training]\nsteps = 10\n\n[optimizer]\nlr = 'fast'\n")
    done = _fresh(
        f"""
        import sys
        from titan_trainer.cli import main
        codes = [
            main(["--training.stpes", "10"]),
            main(["--job.config_file", "debug_model", "--parallelism.tensor_parallel_degre", "2"]),
            main(["--job.config_file", {str(toml)!r}]),
            main(["--training.seq_len", "-4"]),
            main(["--help"]),
        ]
        print("codes", codes)
        assert "torch" not in sys.modules, "torch was imported"
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "codes [2, 2, 2, 2, 0]" in done.stdout, done.stdout + done.stderr
    err = done.stderr
    assert "unknown key [training] stpes (from --training.stpes)\n       did you mean steps?" in err
    assert "did you mean tensor_parallel_degree?" in err
    assert '[optimizer] lr = "fast" is not valid (from bad.toml)' in err
    assert "[training] seq_len = -4 is not valid" in err
    assert "Traceback" not in err
    assert "--training.steps" in done.stdout  # the help, with every key


def test_every_command_answers_version_with_the_packages_beside_it(tmp_path, capsys):
    done = _fresh(
        """
        import sys
        from titan_trainer.cli import main
        main(["--version"])
        assert "torch" not in sys.modules, "torch was imported"
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    from importlib.metadata import version

    from titan_core.versions import version_text

    head, packages = done.stdout.splitlines()
    assert head == f"titan-train {version('titan-llm-trainer')} (titan-llm-trainer)"
    assert f"titan-llm-core {version('titan-llm-core')}" in packages
    assert f"torch {version('torch')}" in packages and "Python 3." in packages
    # The other commands, in this process (titan-ckpt's imports torch first).
    from titan_ckpt.cli import main as titan_ckpt
    from titan_data.cli import main as titan_data
    from titan_trainer.compare import main as titan_compare
    from titan_trainer.download import main as titan_download
    from titan_trainer.generate import main as titan_generate

    for command, main, distribution in [
        ("titan-compare", titan_compare, "titan-llm-trainer"),
        ("titan-generate", titan_generate, "titan-llm-trainer"),
        ("titan-download", titan_download, "titan-llm-trainer"),
        ("titan-ckpt", titan_ckpt, "titan-llm-ckpt"),
        ("titan-data", titan_data, "titan-llm-data"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["--version"])
        assert exited.value.code == 0, command
        assert capsys.readouterr().out == version_text(command, distribution) + "\n", command


@pytest.mark.parametrize("flag", ["--check", "--dry-run"])
def test_the_checks_and_the_dry_run_refuse_a_bad_key_before_torch(tmp_path, flag):
    done = _fresh(
        f"""
        import sys
        from titan_trainer.cli import main
        assert main(["--job.config_file", "llama3_70b", "{flag}", "--training.stpes", "1"]) == 2
        assert "torch" not in sys.modules, "torch was imported"
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "did you mean steps?" in done.stderr
