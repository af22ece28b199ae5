"""What the default suite's sessions left in their junit XML files, in a few lines: the totals
and the slowest test cases across every session, so that CI time stays visible where it goes.

    python tools/junit_summary.py .nox/junit/*.xml [--slowest 25]

Exit status 1 when a test failed or none ran. The noxfile's `summary` session runs it.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    seconds: float
    session: str
    name: str


def totals(paths: list[Path]) -> dict[str, int]:
    """Tests, failures, errors and skipped, added up over every test suite in `paths`."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return counts


def slowest(paths: list[Path], count: int) -> list[Case]:
    """The `count` test cases with the longest `time` over every file, slowest first. A case's
    session is its file's name (nox writes `<session>.xml`); its name is junit's class name
    (the test module, dotted) and the test's name."""
    return sorted(_cases(paths), key=lambda c: c.seconds, reverse=True)[:count]


def _cases(paths: list[Path]) -> list[Case]:
    cases = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            name = "::".join(filter(None, (case.get("classname"), case.get("name"))))
            cases.append(Case(float(case.get("time") or 0), path.stem, name))
    return cases


def report(paths: list[Path], count: int) -> tuple[list[str], bool]:
    """The lines to print, and whether the run passed (no failure or error, and a test ran)."""
    counts = totals(paths)
    cases = slowest(paths, count)
    total = sum(c.seconds for c in _cases(paths))
    lines = [
        f"slowest {len(cases)} tests of {counts['tests']} ({total:.0f} s of test time in all):"
    ]
    width = max((len(c.session) for c in cases), default=0)
    lines += [f"{c.seconds:8.1f} s  {c.session:<{width}}  {c.name}" for c in cases]
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    lines.append(f"summary: {passed} passed, {failed} failed, {counts['skipped']} skipped")
    return lines, not failed and counts["tests"] > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="junit XML files")
    parser.add_argument("--slowest", type=int, default=25, help="how many slow tests to list")
    args = parser.parse_args(argv)
    lines, passed = report(sorted(args.files), args.slowest)
    print("\n".join(lines), file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
