"""tools/junit_summary.py (the noxfile's `summary` session): the totals of every session's junit
file, and the slowest test cases across all of them, from files pytest itself wrote."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import junit_summary  # noqa: E402

# Two "sessions", each a small test file whose tests sleep for known times; one fails.
FAST = """
import time
def test_quick(): time.sleep(0.01)
class TestGroup:
    def test_in_a_class(self): time.sleep(0.3)
"""
SLOW = """
import time, pytest
def test_slowest(): time.sleep(0.6)
def test_fails(): time.sleep(0.15); assert False
@pytest.mark.skip(reason="not here")
def test_skipped(): pass
"""


@pytest.fixture(scope="module")
def junit_files(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("junit")
    files = []
    for session, text in (("tests-fast", FAST), ("tests-slow", SLOW)):
        test = folder / f"test_{session.split('-')[1]}.py"
        test.write_text(text)
        xml = folder / f"{session}.xml"
        subprocess.run(
            [sys.executable, "-m", "pytest", str(test), f"--junitxml={xml}", "-q",
             "-p", "no:cacheprovider", f"--rootdir={folder}"],
            capture_output=True, cwd=folder, timeout=120,
        )  # fmt: skip
        files.append(xml)
    return files


def test_the_slowest_cases_across_sessions_come_first_with_their_times(junit_files):
    cases = junit_summary.slowest(junit_files, 3)
    assert [(c.session, c.name) for c in cases] == [
        ("tests-slow", "test_slow::test_slowest"),
        ("tests-fast", "test_fast.TestGroup::test_in_a_class"),
        ("tests-slow", "test_slow::test_fails"),
    ]
    # junit's `time` is the wall time of each test; sleeps are a floor, load only adds.
    assert cases[0].seconds >= 0.6 and cases[1].seconds >= 0.3 and cases[2].seconds >= 0.15


def test_the_report_lists_the_slowest_then_the_totals_and_fails_on_a_failure(junit_files):
    lines, passed = junit_summary.report(junit_files, 2)
    assert not passed
    assert lines[0].startswith("slowest 2 tests of 5 (")
    assert lines[1].split()[2:] == ["tests-slow", "test_slow::test_slowest"]
    assert lines[2].split()[2:] == ["tests-fast", "test_fast.TestGroup::test_in_a_class"]
    assert lines[-1] == "summary: 3 passed, 1 failed, 1 skipped"
    assert len(lines) == 4
    # Without the failing session the run passes; with no file at all nothing ran: a failure.
    assert junit_summary.report(junit_files[:1], 25)[1]
    assert junit_summary.main([]) == 1
