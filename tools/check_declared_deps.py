"""Each package declares exactly the titan packages its source imports (docs/architecture.md,
"Layers and the rules between them").

An undeclared import breaks `pip install` of that package alone; a declared but unused one
drags a sibling in for nothing. Test files are included: they run against the installed wheel.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = sorted([*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")])


def _module(pyproject: dict) -> str:
    """The module a package's wheel holds (`titan_core` for the distribution titan-llm-core)."""
    (path,) = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    return path.rsplit("/", 1)[-1]


# distribution name -> module, for every workspace member
MODULES = {
    (p := tomllib.loads(path.read_text()))["project"]["name"]: _module(p) for path in MEMBERS
}
DISTRIBUTIONS = {module: dist for dist, module in MODULES.items()}


def plugin_providers() -> set[str]:
    """Packages that register `titan.*` entry points. A package may depend on one without
    importing it: it is found by name at run time (docs/architecture.md, "Plugins")."""
    found = set()
    for pyproject in MEMBERS:
        meta = tomllib.loads(pyproject.read_text())["project"]
        if any(group.startswith("titan.") for group in meta.get("entry-points", {})):
            found.add(MODULES[meta["name"]])
    return found


PLUGIN_PROVIDERS = plugin_providers()


def titan_imports(folder: Path) -> set[str]:
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            found.update(n.split(".")[0] for n in names if n.startswith("titan_"))
    return found


def main() -> int:
    problems = []
    for pyproject in MEMBERS:
        meta = tomllib.loads(pyproject.read_text())["project"]
        own = MODULES[meta["name"]]
        names = {
            r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
            for r in meta.get("dependencies", [])
        }
        declared = {MODULES[n] for n in names if n in MODULES}
        src = titan_imports(pyproject.parent / "src") - {own}
        tests = titan_imports(pyproject.parent / "tests") - {own}
        for name in sorted(src - declared):
            problems.append(
                f"{meta['name']}: imports {name} but does not declare {DISTRIBUTIONS[name]}"
            )
        for name in sorted(tests - declared):
            problems.append(
                f"{meta['name']}: its tests import {name}, which an isolated install lacks"
            )
        for name in sorted(declared - src - PLUGIN_PROVIDERS):
            problems.append(f"{meta['name']}: declares {DISTRIBUTIONS[name]} but never imports it")
    for problem in problems:
        print("layers:", problem)
    print(f"layers: checked {len(MEMBERS)} packages, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
