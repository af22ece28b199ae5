"""Every package carries what a user installing it from an index needs (docs/architecture.md,
"Packaging"): the license, type information, metadata that leads back to the repository, one
version, and dependency ranges it has been tested against.

    python tools/check_packaging.py             # pyprojects, sources and package folders
    python tools/check_packaging.py DIST        # also the wheels and sdists built into DIST

Checked for every package:
- LICENSE, identical to the repository's, in the package folder, its sdist and its wheel;
  `license = "BSD-3-Clause"` with `license-files`;
- `py.typed` in the source and the wheel;
- authors, classifiers (Python versions, `Typing :: Typed`) and project URLs on REPOSITORY;
- a static SemVer version, which `__version__` reads from the installed metadata (no copy);
- an upper bound on every requirement (runtime, extras and build);
- numpy beside torch (torch imports it without declaring it, and warns on every import where it
  is missing);
- its distribution name is `titan-llm-<name>` for the module `titan_<name>`, and every
  requirement on a titan distribution names one of those seven (a name another project holds,
  like `titan-core`, could be satisfied by that project's releases);
- titan-trainer's wheel: its configs, run_train.sh and scripts/multinode.sbatch.
Where the packages are installed (the workspace, or a venv with the built wheels), their
installed version is also compared with the pyproject.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/titan-llm/titan"
LICENSE = "BSD-3-Clause"
AUTHORS = [{"name": "The Titan authors"}]
REQUIRED_CLASSIFIERS = {
    "Programming Language :: Python :: 3.11",
    "Programming Language :: Python :: 3.13",
    "Typing :: Typed",
}
TRAINER_FILES = ("run_train.sh", "scripts/multinode.sbatch")
PREFIX = "titan-llm-"
"""Every Titan distribution is named PREFIX + the module's name after `titan_`: names Titan
holds on the package index (docs/architecture.md, "Packaging")."""
SHORT_NAMES = ("core", "parallel", "ckpt", "float8", "data", "models", "trainer")
DISTRIBUTIONS = frozenset(PREFIX + name for name in SHORT_NAMES)


def members() -> list[Path]:
    """Each package's folder (the one holding its pyproject.toml)."""
    found = [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
    return sorted(p.parent for p in found)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip()


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_of(pyproject: dict) -> str:
    """The import name a package's wheel holds (`[tool.hatch.build.targets.wheel] packages`)."""
    (path,) = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    return path.rsplit("/", 1)[-1]


def wheel_stem(dist: str) -> str:
    """How `dist` starts the names of its wheel and sdist files (`titan_llm_core`)."""
    return _normalized(dist).replace("-", "_")


def foreign_titan_requirements(requirements: list[str]) -> list[str]:
    """Requirements on a `titan...` distribution that is not one of Titan's own."""
    return [
        r
        for r in requirements
        if _normalized(_name(r)).startswith("titan") and _normalized(_name(r)) not in DISTRIBUTIONS
    ]


def _upper_bounded(requirement: str) -> bool:
    spec = requirement.split(";")[0]
    return any(op in spec for op in ("<", "==", "~="))


def check_package(folder: Path, root_license: str, root: Path = ROOT) -> list[str]:
    """Problems with one package's folder, pyproject and sources (`folder` inside `root`)."""
    pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
    meta = pyproject["project"]
    dist = meta["name"]
    module = module_of(pyproject)
    rel = folder.relative_to(root).as_posix()
    problems = []

    def problem(text: str) -> None:
        problems.append(f"{dist}: {text}")

    expected_dist = PREFIX + module.removeprefix("titan_").replace("_", "-")
    if dist != expected_dist:
        problem(
            f"the distribution of {module} is named {expected_dist!r}, one of the names Titan "
            "holds on the package index (docs/architecture.md, Packaging)"
        )

    if meta.get("license") != LICENSE or meta.get("license-files") != ["LICENSE"]:
        problem(f'needs license = "{LICENSE}" and license-files = ["LICENSE"] in [project]')
    license_file = folder / "LICENSE"
    if not license_file.is_file():
        problem(f"has no LICENSE file in {rel}/ (copy the repository's LICENSE)")
    elif license_file.read_text() != root_license:
        problem(f"{rel}/LICENSE differs from the repository's LICENSE")
    if not (folder / "src" / module / "py.typed").is_file():
        problem(f"has no src/{module}/py.typed (an empty file: the package ships type hints)")
    if meta.get("authors") != AUTHORS:
        problem(f"authors should be {AUTHORS}")
    missing = REQUIRED_CLASSIFIERS - set(meta.get("classifiers", []))
    if missing:
        problem(f"classifiers lack {sorted(missing)}")
    if any(c.startswith("License ::") for c in meta.get("classifiers", [])):
        problem("has a License classifier; the SPDX `license` expression replaces it")
    urls = meta.get("urls", {})
    expected = {
        "Homepage": REPOSITORY,
        "Repository": REPOSITORY,
        "Issues": f"{REPOSITORY}/issues",
        "Documentation": f"{REPOSITORY}/tree/main/{rel}#readme",
        "Changelog": f"{REPOSITORY}/blob/main/{rel}/CHANGELOG.md",
    }
    for key, url in expected.items():
        if urls.get(key) != url:
            problem(f"[project.urls] {key} should be {url!r}, not {urls.get(key)!r}")
    if "version" in meta.get("dynamic", []) or not re.fullmatch(
        r"\d+\.\d+\.\d+", str(meta.get("version", ""))
    ):
        problem("needs a static SemVer `version` in [project]")
    problems.extend(f"{dist}: {p}" for p in _version_source_problems(folder / "src" / module, dist))
    requirements = [
        *meta.get("dependencies", []),
        *(r for extra in meta.get("optional-dependencies", {}).values() for r in extra),
        *pyproject.get("build-system", {}).get("requires", []),
    ]
    for requirement in foreign_titan_requirements(requirements):
        problem(
            f"requirement {requirement!r} names a distribution that is not Titan's (Titan's: "
            f"{', '.join(sorted(DISTRIBUTIONS))}); another project's releases could satisfy it"
        )
    declared = {_normalized(_name(r)) for r in meta.get("dependencies", [])}
    if "torch" in declared and "numpy" not in declared:
        problem(
            "requires torch but not numpy: torch imports numpy without declaring it, and warns"
            ' "Failed to initialize NumPy" on every import where it is missing; add'
            ' "numpy>=1.26,<3"'
        )
    for requirement in requirements:
        if not _upper_bounded(requirement):
            problem(
                f"requirement {requirement!r} has no upper bound; cap it above the newest "
                "version tested (the lock file has it)"
            )
    return problems


def _version_source_problems(src: Path, dist: str) -> list[str]:
    """`__version__` in `__init__.py` must be read from the package metadata, and no module may
    carry a version string of its own."""
    problems = []
    init = src / "__init__.py"
    reads_metadata = False
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            call = node.value
            reads_metadata = (
                isinstance(call, ast.Call)
                and getattr(call.func, "attr", getattr(call.func, "id", None)) == "version"
                and [getattr(a, "value", None) for a in call.args] == [dist]
            )
    if not reads_metadata:
        problems.append(
            f'{init.name} needs `__version__ = importlib.metadata.version("{dist}")` '
            "(the pyproject's version is the only one)"
        )
    for path in src.rglob("*.py"):
        if re.search(r"__version__\s*=\s*['\"]", path.read_text()):
            problems.append(f"{path.name} writes a version string by hand")
    return problems


def check_dist(dist_dir: Path, root_license: str) -> list[str]:
    """Problems with the wheels and sdists built into `dist_dir`, one of each per package."""
    problems = []
    for folder in members():
        pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
        dist, version = pyproject["project"]["name"], pyproject["project"]["version"]
        module, stem = module_of(pyproject), wheel_stem(dist)
        wheels = list(dist_dir.glob(f"{stem}-{version}-*.whl"))
        sdists = list(dist_dir.glob(f"{stem}-{version}.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            problems.append(f"{dist}: expected one wheel and one sdist of {version} in {dist_dir}")
            continue
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = set(wheel.namelist())
            info = f"{stem}-{version}.dist-info"
            if f"{module}/py.typed" not in names:
                problems.append(f"{dist}: the wheel lacks {module}/py.typed")
            if f"{info}/licenses/LICENSE" not in names:
                problems.append(f"{dist}: the wheel lacks {info}/licenses/LICENSE")
            elif wheel.read(f"{info}/licenses/LICENSE").decode() != root_license:
                problems.append(f"{dist}: the wheel's LICENSE differs from the repository's")
            metadata = wheel.read(f"{info}/METADATA").decode()
            for line in (
                f"Version: {version}",
                f"License-Expression: {LICENSE}",
                "Author: The Titan authors",
                f"Project-URL: Repository, {REPOSITORY}",
                "Classifier: Typing :: Typed",
            ):
                if line not in metadata.splitlines():
                    problems.append(f"{dist}: the wheel's METADATA lacks {line!r}")
            if module == "titan_trainer":
                problems.extend(_trainer_wheel_problems(wheel, folder))
        with tarfile.open(sdists[0]) as sdist:
            if f"{stem}-{version}/LICENSE" not in sdist.getnames():
                problems.append(f"{dist}: the sdist lacks LICENSE")
    return problems


def _trainer_wheel_problems(wheel: zipfile.ZipFile, folder: Path) -> list[str]:
    problems = []
    shipped = [
        *(p.relative_to(folder).as_posix() for p in sorted(folder.glob("configs/*.toml"))),
        *TRAINER_FILES,
    ]
    for rel in shipped:
        name = f"titan_trainer/{rel}"
        try:
            if wheel.read(name) != (folder / rel).read_bytes():
                problems.append(f"titan-trainer: the wheel's {name} differs from {rel}")
        except KeyError:
            problems.append(f"titan-trainer: the wheel lacks {name} (from {rel})")
    return problems


def check_workspace(root: Path = ROOT) -> list[str]:
    """The root pyproject (the workspace) names Titan's distributions only, and all seven."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    requirements = pyproject["project"].get("dependencies", [])
    problems = [
        f"workspace: requirement {r!r} names a distribution that is not Titan's"
        for r in foreign_titan_requirements(requirements)
    ]
    sources = set(pyproject.get("tool", {}).get("uv", {}).get("sources", {}))
    if sources != DISTRIBUTIONS:
        problems.append(
            f"workspace: [tool.uv.sources] should list exactly {sorted(DISTRIBUTIONS)}, "
            f"not {sorted(sources)}"
        )
    return problems


def check_installed_versions() -> list[str]:
    """The installed metadata's version of each titan package against its pyproject (each
    `__version__` reads that metadata, as `_version_source_problems` makes sure)."""
    problems = []
    for folder in members():
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        try:
            found = importlib.metadata.version(meta["name"])
        except importlib.metadata.PackageNotFoundError:
            continue
        if found != meta["version"]:
            problems.append(
                f"{meta['name']}: the installed version is {found} but the pyproject says "
                f"{meta['version']}; reinstall it (uv sync)"
            )
    return problems


def main(argv: list[str]) -> int:
    root_license = (ROOT / "LICENSE").read_text()
    problems = []
    if "Copyright (c)" not in root_license or "The Titan authors" not in root_license:
        problems.append("LICENSE: the repository's LICENSE must name The Titan authors")
    for folder in members():
        problems.extend(check_package(folder, root_license))
    problems.extend(check_workspace())
    if argv:
        problems.extend(check_dist(Path(argv[0]), root_license))
    problems.extend(check_installed_versions())
    for problem in problems:
        print("packaging:", problem)
    print(
        f"packaging: checked {len(members())} packages"
        + (f" and their builds in {argv[0]}" if argv else "")
        + f", {len(problems)} problems"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
