"""The one entry point for checks. `uv run nox` runs the default set, which is what CI runs.

    uv run nox -l                          # list sessions
    uv run nox -s tests-titan-core         # one package's tests in the workspace env
    uv run nox -s isolated-titan-parallel  # build the wheel, install it alone, test it there
    uv run nox -s bench                    # benchmarks (not in the default set)

Workspace sessions reuse the uv workspace environment (`uv run --frozen`) instead of building
a venv of their own: torch is large and the lock already pins it. Isolated sessions build
real wheels and install them into a clean venv, the way a user gets them from an index.
"""

from __future__ import annotations

import os
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = {
    "titan-core": "packages/titan-core",
    "titan-parallel": "packages/titan-parallel",
    "titan-ckpt": "packages/titan-ckpt",
    "titan-float8": "packages/titan-float8",
    "titan-data": "packages/titan-data",
    "titan-models": "packages/titan-models",
    "titan-trainer": "apps/trainer",
}
# Packages whose default-set tests run isolated (their wheel alone in a clean venv). The
# trainer composes everything, so its tests run in the workspace env.
LIBRARIES = [p for p in PACKAGES if p != "titan-trainer"]
JUNIT = ROOT / ".nox" / "junit"

# Importing torch is several seconds faster with cached bytecode; some environments switch the
# cache off, which every test process would then pay again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "layers",
    *(f"isolated-{p}" for p in LIBRARIES),
    "tests-titan-trainer",
    "summary",
]
nox.options.reuse_existing_virtualenvs = True


def _module(dist: str) -> str:
    return dist.replace("-", "_")


def _pytest_args(session: nox.Session, dist: str) -> list[str]:
    JUNIT.mkdir(parents=True, exist_ok=True)
    return [
        str(ROOT / PACKAGES[dist] / "tests"),
        f"--junitxml={JUNIT / dist}.xml",
        "-q",
        *session.posargs,
    ]


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.run("uv", "run", "--frozen", "ruff", "check", ".")
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def layers(session: nox.Session) -> None:
    """The dependency rules of ARCHITECTURE.md section 1: import contracts and declared deps."""
    session.run("uv", "run", "--frozen", "lint-imports")
    session.run("uv", "run", "--frozen", "python", "tools/check_declared_deps.py")


for _dist in PACKAGES:

    @nox.session(name=f"tests-{_dist}", venv_backend="none")
    def tests(session: nox.Session, dist: str = _dist) -> None:
        """One package's tests in the workspace environment."""
        session.run("uv", "run", "--frozen", "pytest", *_pytest_args(session, dist))


for _dist in PACKAGES:

    @nox.session(name=f"isolated-{_dist}")
    def isolated(session: nox.Session, dist: str = _dist) -> None:
        """Build the wheel (no workspace sources), install it alone with its dependencies into a
        clean venv, show that no other titan package is importable, and run its tests there."""
        wheels = Path(session.create_tmp()) / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        needed = _titan_closure(dist)
        for name in needed:
            session.run(
                "uv",
                "build",
                "--no-sources",
                "--wheel",
                "--quiet",
                "--package",
                name,
                "--out-dir",
                str(wheels),
                external=True,
            )
        built = {name: next(wheels.glob(f"{_module(name)}-*.whl")) for name in needed}
        # Siblings are not on the index yet, so their freshly built wheels stand in for it.
        session.install(f"{built[dist]}[test]", *(str(built[n]) for n in needed if n != dist))
        others = [_module(p) for p in PACKAGES if p not in needed]
        session.run(
            "python",
            "-c",
            "import importlib.util, sys; present = [m for m in sys.argv[1:] if importlib.util.find_spec(m)];"
            " assert not present, f'unexpected titan packages importable: {present}';"
            " print('isolated: no other titan package importable')",
            *others,
        )
        # Run from outside the repo so that only the installed wheel can be imported.
        session.chdir(session.create_tmp())
        session.run(
            "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"--rootdir={ROOT}",
            *_pytest_args(session, dist),
        )


def _titan_closure(dist: str) -> list[str]:
    """The titan distributions `dist` needs (itself first), read from the pyprojects."""
    import tomllib

    order, todo = [], [dist]
    while todo:
        name = todo.pop()
        if name in order:
            continue
        order.append(name)
        meta = tomllib.loads((ROOT / PACKAGES[name] / "pyproject.toml").read_text())["project"]
        for req in meta.get("dependencies", []):
            dep = req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
            if dep in PACKAGES:
                todo.append(dep)
    return order


@nox.session(venv_backend="none")
def summary(session: nox.Session) -> None:
    """Add up the test results of the sessions that ran before it (one closing line)."""
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in sorted(JUNIT.glob("*.xml")):
        root = ET.parse(path).getroot()
        for suite in root.iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
        path.unlink()
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(
        f"summary: {passed} passed, {failed} failed, {totals['skipped']} skipped", file=sys.stderr
    )
    if failed or not totals["tests"]:
        session.error("some tests failed" if failed else "no test ran")


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks (JSON lines on stdout). Not in the default set: timings need a quiet machine."""
    for script in sorted((ROOT / "bench").glob("*.py")):
        session.run(
            "uv",
            "run",
            "--frozen",
            "python",
            str(script),
            *session.posargs,
            env={"PYTHONUNBUFFERED": "1", **os.environ},
        )
