"""tools/check_packaging.py finds each packaging problem it is there for, and the two packages
that had no `__version__` have one, read from their metadata."""

from __future__ import annotations

import importlib
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import check_packaging  # noqa: E402

ROOT = check_packaging.ROOT
LICENSE = (ROOT / "LICENSE").read_text()


@pytest.fixture
def core_copy(tmp_path) -> Path:
    """titan-core's pyproject, LICENSE and sources, at the same place in a scratch repo."""
    folder = tmp_path / "packages" / "titan-core"
    shutil.copytree(ROOT / "packages/titan-core/src", folder / "src")
    for name in ("pyproject.toml", "LICENSE"):
        shutil.copy(ROOT / "packages/titan-core" / name, folder / name)
    return folder


def _problems(folder: Path) -> list[str]:
    return check_packaging.check_package(folder, LICENSE, root=folder.parents[1])


def test_every_package_passes():
    for folder in check_packaging.members():
        assert check_packaging.check_package(folder, LICENSE) == [], folder.name
    assert len(check_packaging.members()) == 7
    assert check_packaging.check_workspace() == []


def test_a_copy_passes_until_something_is_broken(core_copy):
    assert _problems(core_copy) == []


@pytest.mark.parametrize(
    "breakage,expected",
    [
        (lambda f: (f / "LICENSE").unlink(), "has no LICENSE file"),
        (lambda f: (f / "LICENSE").write_text("MIT\n"), "differs from the repository's LICENSE"),
        (lambda f: (f / "src/titan_core/py.typed").unlink(), "py.typed"),
        (lambda f: _edit(f / "pyproject.toml", '    "numpy>=1.26,<3",\n', ""), "requires torch but not numpy"),
        (lambda f: _edit(f / "pyproject.toml", '"torch>=2.11,<2.16"', '"torch>=2.11"'), "'torch>=2.11' has no upper bound"),
        (lambda f: _edit(f / "pyproject.toml", 'authors = [{ name = "The Titan authors" }]\n', ""), "authors"),
        (lambda f: _edit(f / "pyproject.toml", '    "Typing :: Typed",\n', ""), "Typing :: Typed"),
        (lambda f: _edit(f / "pyproject.toml", "titan-llm/titan/issues", "elsewhere/issues"), "Issues"),
        (lambda f: _edit(f / "src/titan_core/__init__.py", 'importlib.metadata.version("titan-llm-core")', '"0.1.0"'), "writes a version string by hand"),
        (lambda f: _edit(f / "pyproject.toml", 'name = "titan-llm-core"', 'name = "titan-core"'), "is named 'titan-llm-core'"),
        (lambda f: _edit(f / "pyproject.toml", '"torch>=2.11,<2.16",', '"torch>=2.11,<2.16", "titan-core>=0.1,<0.2",'), "'titan-core>=0.1,<0.2' names a distribution that is not Titan's"),
        (lambda f: _edit(f / "pyproject.toml", '"torch>=2.11,<2.16",', '"torch>=2.11,<2.16", "Titan_Parallel>=0.1,<0.2",'), "'Titan_Parallel>=0.1,<0.2' names a distribution that is not Titan's"),
    ],
)  # fmt: skip
def test_each_problem_is_found(core_copy, breakage, expected):
    breakage(core_copy)
    problems = _problems(core_copy)
    assert any(expected in p for p in problems), problems


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(
    "module,folder", [("titan_trainer", "apps/trainer"), ("titan_models", "packages/titan-models")]
)
def test_version_comes_from_the_pyproject(module, folder):
    version = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.import_module(module).__version__ == version
