"""The GPU suite for a machine whose Python already has torch with CUDA and that cannot
download anything: everything it needs in one folder, made here, carried there.

    uv run python tools/gpu_bundle.py gpu-bundle      # here, where PyPI is reachable
    bash gpu-bundle/run_gpu_tests.sh                  # there (copy the folder over first)

The folder holds:
- `wheels/`: the workspace's wheels (built from this checkout, as an index would get them), and
  the third-party wheels they need from uv.lock, except torch and what comes with it (triton,
  the CUDA libraries, sympy, ...), which the machine has (`--no-third-party` leaves them out,
  for a machine that has them too, `--only-third-party a,b` takes only those, for one that has
  the rest; `--python-version` picks the wheels for its Python);
- `repo/`: this checkout's tracked files without the package sources (tests, configs, READMEs,
  the pytest settings), so that the tests can only import the installed wheels;
- `gpu_test_files.txt`: the test files that hold tests marked `gpu`, a line per package;
- `run_gpu_tests.sh`: installs the wheels with `pip install --no-deps --no-index --target`
  into a folder of their own (`$TITAN_TARGET`, default `site-packages/` in the bundle), so the
  machine's Python is left as it is, puts that folder first on `PYTHONPATH`, and runs every
  test marked `gpu` of every package. `$PYTHON` (default `python3`) is the Python with torch;
  `$PIP` (default `$PYTHON -m pip`) installs. Arguments go to pytest.

`--with-torchtitan` adds torchtitan 0.2.2's wheel and the pure-Python packages it needs that
the bundle does not hold already (resolved by uv with the workspace's locked versions as
constraints, less torch and what comes with it: torchdata, tyro and its dependencies, einops,
tomli), and `run_vs_torchtitan.sh`: the same install, then `import torchtitan.train` (a broken
install fails before anything is measured) and bench/vs_torchtitan.py, Titan against
torchtitan side by side; arguments go to it.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a CUDA torch installs beside itself: the GPU machine has them with its torch.
WITH_TORCH = re.compile(
    r"^(torch|triton|nvidia-.*|cuda-.*|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec"
    r"|typing-extensions|setuptools)$"
)

TORCHTITAN = "torchtitan==0.2.2"
# Installs the wheels beside the script into a folder of their own (no network, the Python's
# own packages untouched) and puts that folder first on PYTHONPATH.
INSTALL = """set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"
pip="${PIP:-$python -m pip}"
target="${TITAN_TARGET:-$here/site-packages}"
$pip install --no-deps --no-index --upgrade --target "$target" "$here"/wheels/*.whl
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
"""

RUN_SCRIPT = (
    """#!/usr/bin/env bash
# Install the wheels beside this script, then run every test marked `gpu` against them. See
# tools/gpu_bundle.py in the Titan repository.
"""
    + INSTALL
    + """"$python" -c 'import titan_core, torch; print("gpu suite: titan from", titan_core.__file__,
  "| torch", torch.__version__, "| CUDA GPUs:", torch.cuda.device_count())'
status=0
# One pytest per package (each tests folder has its own conftest), over its files that hold
# tests marked gpu.
while read -r files; do
  "$python" -m pytest -m gpu -rs -p no:cacheprovider --rootdir "$here/repo" \\
    $(for f in $files; do echo "$here/repo/$f"; done) "$@" </dev/null || status=$?
done < "$here/gpu_test_files.txt"
exit "$status"
"""
)

VS_TORCHTITAN_SCRIPT = (
    """#!/usr/bin/env bash
# Install the wheels beside this script (torchtitan 0.2.2 among them), then run
# bench/vs_torchtitan.py: Titan against torchtitan side by side on this GPU. Arguments go to it.
# See tools/gpu_bundle.py in the Titan repository.
"""
    + INSTALL
    + """"$python" -c 'import importlib.metadata as m, titan_core, torch, torchtitan.train
print("vs torchtitan: torchtitan", m.version("torchtitan"), "from", torchtitan.__file__,
  "| titan from", titan_core.__file__, "| torch", torch.__version__, "| CUDA GPUs:",
  torch.cuda.device_count())'
exec "$python" "$here/repo/bench/vs_torchtitan.py" "$@"
"""
)


def build_wheels(wheels: Path) -> None:
    subprocess.run(
        ["uv", "build", "--all-packages", "--no-sources", "--wheel", "--quiet",
         "--out-dir", str(wheels)],
        cwd=ROOT, check=True,
    )  # fmt: skip


@functools.cache
def _export() -> str:
    """The workspace's locked third-party requirements, pinned (uv export; once per run)."""
    return subprocess.run(
        ["uv", "export", "--frozen", "--no-hashes", "--no-emit-workspace", "--no-dev",
         "--all-packages", "--all-extras", "--no-header", "--no-annotate"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def _name(line: str) -> str | None:
    """The distribution a requirement line names (lowercase); None for comments and options."""
    line = line.strip()
    if not line or line.startswith(("#", "-")):
        return None
    return re.split(r"[=<>;\[ ]", line, maxsplit=1)[0].lower()


def third_party_requirements(only: set[str] | None = None) -> list[str]:
    """The locked third-party packages the workspace's libraries and trainer need at run time
    (and pytest), less torch and what comes with it; with `only`, just those of them."""
    keep = [
        line.strip()
        for line in _export().splitlines()
        if (name := _name(line)) is not None and not WITH_TORCH.match(name)
    ]
    if only is None:
        return keep
    unknown = only - {_name(line) for line in keep}
    if unknown:
        raise SystemExit(
            f"gpu bundle: --only-third-party names {', '.join(sorted(unknown))}, which uv.lock"
            " does not hold (or that come with torch)\n"
            "            name packages of the workspace's lock, as `uv export` writes them"
        )
    return [line for line in keep if _name(line) in only]


def torchtitan_requirements(python_version: str) -> list[str]:
    """torchtitan and the packages it needs that are neither locked by the workspace (the
    bundle's third-party wheels, or the machine's own with --no-third-party) nor torch and what
    comes with it: uv resolves them for the GPU machine's Python, the lock's versions as
    constraints."""
    locked = _export()
    with tempfile.TemporaryDirectory() as tmp:
        wanted, constraints = Path(tmp) / "in.txt", Path(tmp) / "constraints.txt"
        wanted.write_text(TORCHTITAN + "\n")
        constraints.write_text(locked)
        resolved = subprocess.run(
            ["uv", "pip", "compile", str(wanted), "--constraints", str(constraints), "--quiet",
             "--no-header", "--no-annotate", "--python-version", python_version,
             "--python-platform", "x86_64-manylinux_2_28"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    have = {_name(line) for line in locked.splitlines()}
    return [
        line.strip()
        for line in resolved.splitlines()
        if (name := _name(line)) is not None and name not in have and not WITH_TORCH.match(name)
    ]


def download(requirements: list[str], wheels: Path, python_version: str, listing: str) -> None:
    path = wheels.parent / listing
    path.write_text("\n".join(requirements) + "\n")
    subprocess.run(
        ["uv", "tool", "run", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux2014_x86_64", "--platform", "linux_x86_64",
         "--dest", str(wheels), "-r", str(path)],
        check=True,
    )  # fmt: skip


def copy_repo(dest: Path) -> None:
    """The tracked files, without the package sources (those come from the wheels)."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    for name in files:
        if re.match(r"^(packages/[^/]+|apps/[^/]+)/src/", name) or not (ROOT / name).is_file():
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def gpu_test_files() -> list[list[str]]:
    """The tracked test files that mark tests `gpu`, grouped by tests folder."""
    files = subprocess.run(
        ["git", "ls-files", "*/tests/test_*.py"], cwd=ROOT, check=True, capture_output=True,
        text=True,
    ).stdout.splitlines()  # fmt: skip
    groups: dict[str, list[str]] = {}
    for name in files:
        if "pytest.mark.gpu" in (ROOT / name).read_text():
            groups.setdefault(str(Path(name).parent), []).append(name)
    return list(groups.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", help="the folder to make (replaced if it exists)")
    third_party = parser.add_mutually_exclusive_group()
    third_party.add_argument(
        "--no-third-party", action="store_true", help="only the workspace's wheels"
    )
    third_party.add_argument(
        "--only-third-party",
        default=None,
        help="only these locked third-party packages (comma-separated), for a machine that has"
        " the others",
    )
    parser.add_argument(
        "--with-torchtitan",
        action="store_true",
        help=f"add {TORCHTITAN} and what it needs beyond the lock, and run_vs_torchtitan.sh",
    )
    parser.add_argument(
        "--python-version",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="the GPU machine's Python, for the third-party wheels (default: this one's)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    wheels = out / "wheels"
    # What to download is resolved first: a package --only-third-party names wrongly is refused
    # before the old folder is removed or the workspace's wheels are built.
    downloads = {}
    if not args.no_third_party:
        only = set(args.only_third_party.lower().split(",")) if args.only_third_party else None
        downloads["third_party.txt"] = third_party_requirements(only)
    if args.with_torchtitan:
        downloads["torchtitan.txt"] = torchtitan_requirements(args.python_version)
    shutil.rmtree(out, ignore_errors=True)
    build_wheels(wheels)
    for listing, requirements in downloads.items():
        download(requirements, wheels, args.python_version, listing)
    copy_repo(out / "repo")
    (out / "gpu_test_files.txt").write_text(
        "".join(" ".join(group) + "\n" for group in gpu_test_files())
    )
    script = out / "run_gpu_tests.sh"
    script.write_text(RUN_SCRIPT)
    script.chmod(0o755)
    if args.with_torchtitan:
        vs = out / "run_vs_torchtitan.sh"
        vs.write_text(VS_TORCHTITAN_SCRIPT)
        vs.chmod(0o755)
    count = len(list(wheels.glob("*.whl")))
    print(f"gpu bundle: {out} ({count} wheels); on the GPU machine: bash {script.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
