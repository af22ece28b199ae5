"""End-to-end runs through the command a user types."""

from __future__ import annotations

from conftest import run_cli


def test_bad_flag_fails_fast_with_the_message(debug_args):
    result = run_cli([*debug_args, "--parallelism.tensor_parallel_degre", "2"])
    assert result.returncode == 2
    assert result.stderr.startswith(
        "titan: config error: unknown key [parallelism] tensor_parallel_degre"
    )
    assert "Traceback" not in result.stderr
