"""Releases of the seven packages, each versioned on its own (docs/releasing.md).

    python tools/release.py plan     # what a release now would be: each package's next version, and why
    python tools/release.py check    # CI (nox -s release): changelogs, versions and sibling bounds agree
    python tools/release.py apply    # release: versions, changelogs and bounds written (then `uv lock`)
    python tools/release.py oldest PACKAGE   # its siblings' oldest allowed releases (nox -s oldest-siblings)

A package's CHANGELOG.md opens with `## Unreleased`, its entries the changes since its last
release; each release is a `## X.Y.Z` section, newest first, and the pyproject's version is
the newest. A release is the commit that first carries that version in the package's
pyproject (found in the git history; nothing else records it).

Which version comes next (SemVer; in 0.x the minor is the breaking digit, as Cargo and pip
read it): nothing when Unreleased is empty; a breaking release when the public API lost or
changed something a caller could use since the last release (`public_api.breaking_changes`), or
an entry starts with "Breaking:" (a change of behaviour the signatures do not show); from 1.0,
a minor release when public names were added; else a patch release.

A requirement on a sibling follows what the package really uses of it: from the oldest
release of the sibling that still takes every name the package's sources and tests import
from it as they use it now (`public_api.used_names`), to below the sibling's next breaking
release. `nox -s oldest-siblings` installs each package with its siblings' oldest allowed
releases (built from their release commits) and runs its tests there.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from public_api import (  # noqa: E402
    Api,
    at_commit,
    breaking_changes,
    definition,
    package_api,
    used_names,
    working_tree,
)

ROOT = Path(__file__).resolve().parent.parent
UNRELEASED = "## Unreleased"
HEADING = re.compile(r"^## (\d+)\.(\d+)\.(\d+)\s*$", re.M)
SIBLING = re.compile(r"^(titan-llm-[a-z0-9]+)(\[[^\]]*\])?(.*)$")
BREAKING = "Breaking:"

Version = tuple[int, int, int]


def text(version: Version) -> str:
    return ".".join(map(str, version))


def parse(version: str) -> Version:
    major, minor, patch = (int(x) for x in version.split("."))
    return major, minor, patch


@dataclass
class Package:
    folder: str
    """From the repository root: `packages/titan-core`."""
    distribution: str
    module: str
    version: Version
    unreleased: list[str]
    releases: list[Version]
    """Released versions, newest first (the CHANGELOG's headings)."""
    requires: dict[str, str] = field(default_factory=dict)
    """Sibling distribution -> its version specifier, as the pyproject's dependencies say."""

    @property
    def src(self) -> str:
        return f"{self.folder}/src"


def load(root: Path = ROOT) -> dict[str, Package]:
    """Every package of the workspace, by distribution name."""
    found = {}
    for pyproject in sorted(
        [*root.glob("packages/*/pyproject.toml"), *root.glob("apps/*/pyproject.toml")]
    ):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        (module_path,) = data["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
        unreleased, releases = read_changelog(pyproject.parent / "CHANGELOG.md")
        requires = {}
        for requirement in project.get("dependencies", []):
            match = SIBLING.match(requirement.replace(" ", ""))
            if match:
                requires[match[1]] = match[3]
        found[project["name"]] = Package(
            pyproject.parent.relative_to(root).as_posix(),
            project["name"],
            module_path.rsplit("/", 1)[-1],
            parse(project["version"]),
            unreleased,
            releases,
            requires,
        )
    return found


def read_changelog(path: Path) -> tuple[list[str], list[Version]]:
    """(the Unreleased section's entries, the released versions newest first)."""
    content = path.read_text()
    if UNRELEASED not in content:
        raise ValueError(f"{path} has no '{UNRELEASED}' section")
    start = content.index(UNRELEASED) + len(UNRELEASED)
    first = HEADING.search(content, start)
    section = content[start : first.start() if first else len(content)]
    entries = [line[2:].strip() for line in section.splitlines() if line.startswith("- ")]
    releases = [(int(a), int(b), int(c)) for a, b, c in HEADING.findall(content)]
    return entries, releases


# ----------------------------------------------------------------------------- git


LEDGER = "tools/releases.toml"
"""Release commits the git history cannot tell (0.1.0, from before this process)."""


@cache
def release_commit(root: Path, folder: str, version: Version) -> str | None:
    """The commit that first carries `version` in the package's pyproject, or the one the
    ledger names (None: not committed, or a history too shallow to hold it)."""
    ledger = root / LEDGER
    if ledger.is_file():
        name = tomllib.loads((root / folder / "pyproject.toml").read_text())["project"]["name"]
        named = tomllib.loads(ledger.read_text()).get(name, {}).get(text(version))
        if named:
            return named
    done = subprocess.run(
        ["git", "log", "--reverse", "--format=%H", "-S", f'version = "{text(version)}"', "--",
         f"{folder}/pyproject.toml"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    commits = done.stdout.split()
    return commits[0] if done.returncode == 0 and commits else None


def _name_at(root: Path, commit: str, folder: str) -> str | None:
    pyproject = at_commit(root, commit)(f"{folder}/pyproject.toml")
    return tomllib.loads(pyproject)["project"]["name"] if pyproject else None


def public_modules(root: Path, package: Package) -> list[str]:
    """Beside the package's `__all__`, what else is its public API: each subpackage with an
    `__all__` of its own, and the modules its pyproject names in `[tool.titan.release]
    public-modules` (the trainer's config, whose dataclasses are the keys of every TOML)."""
    top = root / package.src / package.module
    found = [
        f"{package.module}.{init.parent.name}"
        for init in sorted(top.glob("*/__init__.py"))
        if "__all__" in init.read_text()
    ]
    data = tomllib.loads((root / package.folder / "pyproject.toml").read_text())
    named = data.get("tool", {}).get("titan", {}).get("release", {}).get("public-modules", [])
    return found + list(named)


def api_at(root: Path, package: Package, version: Version | None) -> Api:
    """The package's public API at its release `version` (None: the working tree)."""
    modules = public_modules(root, package)
    if version is None:
        return package_api(working_tree(root), package.src, package.module, modules)
    commit = release_commit(root, package.folder, version)
    if commit is None:
        raise LookupError(
            f"{package.distribution} {text(version)}: no commit carries it in"
            f" {package.folder}/pyproject.toml (a shallow clone? fetch the whole history)"
        )
    return package_api(at_commit(root, commit), package.src, package.module, modules)


# ----------------------------------------------------------------------------- the plan


@dataclass
class Step:
    """A package's next release: its version, and why."""

    package: Package
    version: Version | None
    why: list[str]


def api_changes(root: Path, package: Package) -> tuple[list[str], list[str], list[str]]:
    """(names added, names changed compatibly, breaking changes) since the last release."""
    before, now = api_at(root, package, package.version), api_at(root, package, None)
    added = sorted(set(now.entries) - set(before.entries))
    changed, breaking = [], []
    for name, old in before.entries.items():
        why = breaking_changes(old, now.entries.get(name))
        if why:
            breaking.append(f"{name}: {'; '.join(why)}")
        elif old != now.entries.get(name):
            changed.append(name)
    return added, changed, breaking


def next_step(root: Path, package: Package) -> Step:
    if not package.unreleased:
        return Step(package, None, ["nothing under Unreleased"])
    added, changed, breaking = api_changes(root, package)
    marked = [e for e in package.unreleased if e.startswith(BREAKING)]
    major, minor, patch = package.version
    if breaking or marked:
        version = (major + 1, 0, 0) if major else (0, minor + 1, 0)
        why = [f"breaking: {b}" for b in breaking] + [f"breaking (CHANGELOG): {m}" for m in marked]
    elif added and major:
        version, why = (major, minor + 1, 0), [f"added: {', '.join(added)}"]
    else:
        version = (major, minor, patch + 1)
        why = [f"compatible: {len(package.unreleased)} CHANGELOG entries"]
    return Step(package, version, why)


def sibling_bounds(root: Path, package: Package, sibling: Package, new: Version) -> str:
    """`>=L,<U` for `package`'s requirement on `sibling` (whose version is, or will be, `new`):
    L the oldest release of the sibling that still takes what the package uses of it as it
    uses it now, U the sibling's next breaking version."""
    folders = [
        f for f in (f"{package.folder}/src", f"{package.folder}/tests") if (root / f).is_dir()
    ]
    used = sorted(used_names(root, folders, sibling.module))
    now = working_tree(root)
    current = {u: definition(now, sibling.src, u[0], u[1]) for u in used}
    lowest = new
    for release in sibling.releases:  # newest first
        if release >= new:
            continue
        commit = release_commit(root, sibling.folder, release)
        if commit is None or _name_at(root, commit, sibling.folder) != sibling.distribution:
            break  # before it was published under this name, no requirement can reach it
        then = at_commit(root, commit)
        if any(
            definition(then, sibling.src, module, name) is None
            or breaking_changes(
                current[(module, name)], definition(then, sibling.src, module, name)
            )
            for module, name in used
            if current[(module, name)] is not None
        ):
            break
        lowest = release
    upper = f"{new[0] + 1}" if new[0] else f"0.{new[1] + 1}"
    return f">={text(lowest)},<{upper}"


def plan(root: Path = ROOT) -> dict[str, Step]:
    packages = load(root)
    return {name: next_step(root, p) for name, p in packages.items()}


# ----------------------------------------------------------------------------- check


def check(root: Path = ROOT) -> list[str]:
    """Problems: a version that is not the newest release of its changelog, a public API that
    changed with nothing under Unreleased (its next release would not move the version), a
    sibling bound that is not what the packages' use of each other gives."""
    packages = load(root)
    problems = []
    for name, p in packages.items():
        if not p.releases or p.releases[0] != p.version:
            problems.append(
                f"{name}: version {text(p.version)} is not the newest release of its CHANGELOG"
                f" ({', '.join(map(text, p.releases[:3])) or 'none'}); tools/release.py apply"
                " writes both"
            )
            continue
        try:
            added, changed, breaking = api_changes(root, p)
        except LookupError as e:
            problems.append(str(e))
            continue
        if (added or changed or breaking) and not p.unreleased:
            what = [*(f"added {a}" for a in added), *(f"changed {c}" for c in changed), *breaking]
            problems.append(
                f"{name}: its public API changed since {text(p.version)} ({'; '.join(what[:4])}"
                f"{' ...' if len(what) > 4 else ''}), and its CHANGELOG's Unreleased section is"
                " empty: the next release would keep the version; describe the change there"
            )
        for sibling, spec in p.requires.items():
            expected = sibling_bounds(root, p, packages[sibling], packages[sibling].version)
            if spec != expected:
                problems.append(
                    f"{name}: requires {sibling}{spec}, but what it uses of {sibling} gives"
                    f" {expected} (tools/release.py apply writes it)"
                )
    return problems


# ----------------------------------------------------------------------------- apply


def apply(root: Path = ROOT) -> dict[str, Step]:
    """Make the release: each package with Unreleased entries gets its next version (pyproject
    and a changelog section of its own), then every sibling requirement its bounds."""
    steps = plan(root)
    packages = load(root)
    for name, step in steps.items():
        if step.version is None:
            continue
        p = step.package
        folder = root / p.folder
        pyproject = folder / "pyproject.toml"
        pyproject.write_text(
            re.sub(r'^version = "[^"]*"', f'version = "{text(step.version)}"',
                   pyproject.read_text(), count=1, flags=re.M)
        )  # fmt: skip
        changelog = folder / "CHANGELOG.md"
        changelog.write_text(
            changelog.read_text().replace(UNRELEASED, f"{UNRELEASED}\n\n## {text(step.version)}", 1)
        )
        packages[name].version = step.version
    for p in packages.values():
        pyproject = root / p.folder / "pyproject.toml"
        content = pyproject.read_text()
        for sibling in p.requires:
            bounds = sibling_bounds(root, p, packages[sibling], packages[sibling].version)
            content = re.sub(
                rf'"{re.escape(sibling)}(\[[^\]]*\])?[^"]*"',
                lambda m, s=sibling, b=bounds: f'"{s}{m[1] or ""}{b}"',
                content,
            )
        pyproject.write_text(content)
    return steps


def oldest(root: Path, distribution: str) -> dict[str, tuple[Version, str | None]]:
    """Each sibling `distribution` requires: (its oldest allowed release, that release's commit;
    None when it is the working tree's version)."""
    packages = load(root)
    p = packages[distribution]
    out = {}
    for sibling, spec in p.requires.items():
        s = packages[sibling]
        lowest = _lower_bound(spec) or s.version
        out[sibling] = (
            lowest,
            None if lowest == s.version else release_commit(root, s.folder, lowest),
        )
    return out


def _lower_bound(spec: str) -> Version | None:
    match = re.search(r">=(\d+)\.(\d+)(?:\.(\d+))?", spec)
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "plan"
    if command == "plan":
        for name, step in plan().items():
            head = f"{name} {text(step.package.version)}"
            if step.version is None:
                print(f"{head}: no release ({step.why[0]})")
                continue
            print(f"{head} -> {text(step.version)}")
            for why in step.why[:8]:
                print(f"    {why}")
        return 0
    if command == "check":
        problems = check()
        for problem in problems:
            print(f"release: {problem}", file=sys.stderr)
        print(f"release: checked {len(load())} packages, {len(problems)} problems")
        return 1 if problems else 0
    if command == "apply":
        for name, step in apply().items():
            if step.version is not None:
                print(f"{name} {text(step.package.version)} -> {text(step.version)}")
        print("now: uv lock, then commit (the commit is the release)")
        return 0
    if command == "oldest" and len(argv) == 2:
        for sibling, (version, commit) in oldest(ROOT, argv[1]).items():
            print(f"{sibling} {text(version)} {commit or 'working-tree'}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
