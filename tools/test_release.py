"""The release process (docs/releasing.md) end to end, on a repository of two small
pure-Python packages made here (a core and a package that uses one of its functions), with
real git commits, real wheels and a real venv. This repository's own check is `nox -s
release`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import release  # noqa: E402

PYPROJECT = """\
[project]
name = "{dist}"
version = "{version}"
requires-python = ">=3.11"
dependencies = [{deps}]

[build-system]
requires = ["hatchling>=1.27,<2"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["src/{module}"]
"""

CORE = """
__all__ = ["scale", "shift"]


def scale(x, factor=2):
    return x * factor


def shift(x, by=1):
    return x + by
"""

USER = """
from titan_core import scale

__all__ = ["double"]


def double(x):
    return scale(x)
"""


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _package(repo: Path, short: str, module: str, source: str, deps: str = "") -> None:
    folder = repo / "packages" / short
    (folder / "src" / module).mkdir(parents=True)
    (folder / "src" / module / "__init__.py").write_text(textwrap.dedent(source))
    dist = "titan-llm-" + short.removeprefix("titan-")
    (folder / "pyproject.toml").write_text(
        PYPROJECT.format(dist=dist, version="0.1.0", deps=deps, module=module)
    )
    (folder / "CHANGELOG.md").write_text("# Changelog\n\n## Unreleased\n\n## 0.1.0\n- First.\n")


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _entry(repo: Path, short: str, line: str) -> None:
    path = repo / "packages" / short / "CHANGELOG.md"
    path.write_text(path.read_text().replace("## Unreleased\n", f"## Unreleased\n- {line}\n", 1))


def _edit(repo: Path, short: str, module: str, old: str, new: str) -> None:
    path = repo / "packages" / short / "src" / module / "__init__.py"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def _requirement(repo: Path) -> list[str]:
    import tomllib

    return tomllib.loads((repo / "packages/titan-data/pyproject.toml").read_text())["project"][
        "dependencies"
    ]


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "test@example.com")
    _git(repo, "config", "user.name", "test")
    _package(repo, "titan-core", "titan_core", CORE)
    _package(repo, "titan-data", "titan_data", USER, deps='"titan-llm-core>=0.1.0,<0.2"')
    _commit(repo, "0.1.0 of both")
    return repo


def test_versions_move_as_the_changes_and_bounds_follow_the_use(repo):
    assert release.check(repo) == []
    # An API change with nothing under Unreleased: the next release would keep the version.
    _edit(repo, "titan-core", "titan_core", '"shift"]', '"shift", "clamp"]')
    _edit(
        repo, "titan-core", "titan_core", "def shift", "def clamp(x):\n    return x\n\n\ndef shift"
    )
    (problem,) = release.check(repo)
    assert problem.startswith("titan-llm-core: its public API changed since 0.1.0 (added clamp)")
    assert "Unreleased section is empty" in problem

    # Said in the changelog: a compatible release, and the user keeps accepting 0.1.0, since
    # `scale` (all it uses) is what it was there.
    _entry(repo, "titan-core", "`clamp`.")
    assert release.check(repo) == []
    step = release.plan(repo)["titan-llm-core"]
    assert release.text(step.version) == "0.1.1" and step.why == ["compatible: 1 CHANGELOG entries"]
    assert release.plan(repo)["titan-llm-data"].version is None  # nothing under Unreleased
    release.apply(repo)
    assert _requirement(repo) == ["titan-llm-core>=0.1.0,<0.2"]
    assert (
        "## Unreleased\n\n## 0.1.1\n- `clamp`."
        in (repo / "packages/titan-core/CHANGELOG.md").read_text()
    )
    _commit(repo, "release: titan-llm-core 0.1.1")
    assert release.check(repo) == []

    # A breaking change of what the user uses: the minor moves, and the user's bound with it.
    _edit(repo, "titan-core", "titan_core", "def scale(x, factor=2)", "def scale(x, factor)")
    _edit(repo, "titan-data", "titan_data", "return scale(x)", "return scale(x, 2)")
    _entry(repo, "titan-core", "`scale` needs its factor.")
    _entry(repo, "titan-data", "Passes the factor.")
    steps = release.plan(repo)
    assert release.text(steps["titan-llm-core"].version) == "0.2.0"
    assert steps["titan-llm-core"].why == ["breaking: scale: parameter factor lost its default"]
    assert release.text(steps["titan-llm-data"].version) == "0.1.1"
    release.apply(repo)
    # The user passes the factor now, which every release of core takes: 0.1.0 still
    # serves it, up to before 0.3.
    assert _requirement(repo) == ["titan-llm-core>=0.1.0,<0.3"]
    _commit(repo, "release: titan-llm-core 0.2.0, titan-llm-data 0.1.1")
    assert release.check(repo) == []

    # The user calls what only the newest release has: its lower bound moves up to it.
    _edit(
        repo,
        "titan-data",
        "titan_data",
        "from titan_core import scale",
        "from titan_core import clamp, scale",
    )
    _edit(repo, "titan-data", "titan_data", "return scale(x, 2)", "return clamp(scale(x, 2))")
    (problem,) = release.check(repo)
    assert problem.startswith(
        "titan-llm-data: requires titan-llm-core>=0.1.0,<0.3, but what it uses of titan-llm-core"
        " gives >=0.1.1,<0.3"
    ), problem


def test_a_package_installs_and_runs_with_its_siblings_oldest_allowed_release(repo, tmp_path):
    # Core 0.1.1 adds a function the user does not use: the user still allows 0.1.0, which is
    # built from its release commit and installed beside the user's newest release.
    first = _git(repo, "rev-parse", "HEAD")
    _edit(repo, "titan-core", "titan_core", '"shift"]', '"shift", "clamp"]')
    _edit(
        repo, "titan-core", "titan_core", "def shift", "def clamp(x):\n    return x\n\n\ndef shift"
    )
    _entry(repo, "titan-core", "`clamp`.")
    _entry(repo, "titan-data", "Nothing new but its version.")
    release.apply(repo)
    _commit(repo, "release")
    oldest = release.oldest(repo, "titan-llm-data")
    assert oldest == {"titan-llm-core": ((0, 1, 0), first)}
    uv = shutil.which("uv")
    assert uv, "uv builds and installs the wheels, as nox's sessions do"
    wheels, old = tmp_path / "wheels", tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(
        ["git", "archive", first, "packages/titan-core"], cwd=repo, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    for folder in (old / "packages/titan-core", repo / "packages/titan-data"):
        subprocess.run(
            [uv, "build", "--wheel", "--quiet", "--offline", "--out-dir", str(wheels), str(folder)],
            check=True, capture_output=True,
        )  # fmt: skip
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--offline", "--no-index", "--find-links", str(wheels),
         "--python", str(python), "titan-llm-data"],
        check=True, capture_output=True,
    )  # fmt: skip
    done = subprocess.run(
        [str(python), "-c",
         "import importlib.metadata as m, titan_data; print(m.version('titan-llm-core'),"
         " m.version('titan-llm-data'), titan_data.double(21))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["0.1.0", "0.1.1", "42"]
