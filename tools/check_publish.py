"""The publish path, end to end: upload the seven distributions to a package index and install
the trainer from it by name, the way a user's `pip install titan-llm-trainer` would.

    python tools/check_publish.py DIST VENV_PYTHON

DIST holds the wheels and sdists of the seven packages (`uv build --all-packages
--no-sources`); VENV_PYTHON is the interpreter of a clean venv to install into. Run from the
workspace environment, which has twine and pypiserver (dev dependencies). In order:

1. `twine check --strict` on every file (what the index would refuse or render badly);
2. a real index server (pypiserver) on the loopback, with no fallback to the public index;
   `twine upload` puts the seven wheels and sdists on it. Beside them lies a stand-in for
   the unrelated `titan-core` the public index holds, at a version inside the range Titan's
   own pins used to ask for (`titan-core>=0.1,<0.2`): the dependency-confusion case;
3. the third-party requirements the seven wheels declare go into the venv first (uv, from its
   cache or the public index: torch is not downloaded again), then `pip install
   titan-llm-trainer[test]` runs with the local index as its only source and no
   configuration, so every titan distribution is resolved by name from that index. pip's
   installation report must list exactly the seven, each downloaded from the local index;
   the stand-in, which pip can fetch from there when asked for it, is never installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).parent))
from check_packaging import DISTRIBUTIONS, members  # noqa: E402

TRAINER = "titan-llm-trainer"
FOREIGN = ("titan-core", "0.1.99")
"""The name another project holds on the public index, at a version the old pins accepted."""


def main(argv: list[str]) -> int:
    dist, python = Path(argv[0]).resolve(), argv[1]
    files = sorted(str(p) for p in dist.iterdir() if p.suffix in (".whl", ".gz"))
    assert len(files) == 2 * len(DISTRIBUTIONS), f"expected 7 wheels and 7 sdists in {dist}"
    run([sys.executable, "-m", "twine", "check", "--strict", *files])
    with tempfile.TemporaryDirectory() as tmp:
        packages = Path(tmp) / "packages"
        packages.mkdir()
        _write_stand_in(packages, *FOREIGN)
        with _index_server(packages) as url:
            run(
                [sys.executable, "-m", "twine", "upload", "--repository-url", url,
                 "--non-interactive", "-u", "titan", "-p", "titan", "--disable-progress-bar",
                 *files],
            )  # fmt: skip
            _install_third_party(python, dist)
            report = Path(tmp) / "report.json"
            _pip(python, url, ["install", "--report", str(report), f"{TRAINER}[test]"])
            problems = _report_problems(json.loads(report.read_text()), url)
            # The stand-in is there to be found: the old pins would have taken it.
            _pip(python, url, ["download", "--no-deps", "-d", tmp, "titan-core>=0.1,<0.2"])
            if not (Path(tmp) / _stand_in_name(*FOREIGN)).is_file():
                problems.append("pip could not fetch the stand-in titan-core from the index")
    installed = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('titan-core'))"],
        capture_output=True,
        text=True,
    )
    if installed.returncode == 0:
        problems.append(f"the foreign titan-core {installed.stdout.strip()} got installed")
    for problem in problems:
        print("publish:", problem)
    print(
        f"publish: {len(files)} files passed twine check --strict and were uploaded; pip "
        f"installed {TRAINER} and its siblings by name from the local index; "
        f"{len(problems)} problems"
    )
    return 1 if problems else 0


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("publish: $", " ".join(Path(c).name if os.sep in c else c for c in cmd[:6]), "...")
    return subprocess.run(cmd, check=True, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _index_server:
    """pypiserver on the loopback serving `folder`; anyone may upload; a package it does not
    hold is not looked up on the public index (no fallback)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self) -> str:
        port = _free_port()
        self.log = open(self.folder.parent / "pypiserver.log", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port),
             "-a", ".", "-P", ".", "--disable-fallback", str(self.folder)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "simple/", timeout=5).close()
                return url
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    self.log.seek(0)
                    raise RuntimeError(
                        f"pypiserver did not start on {url}:\n{self.log.read()[-3000:]}"
                    ) from None
                time.sleep(0.2)

    def __exit__(self, *_) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def _stand_in_name(name: str, version: str) -> str:
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def _write_stand_in(folder: Path, name: str, version: str) -> None:
    """A minimal wheel of another project that took `name`: it imports as titan_core and
    fails loudly."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        "titan_core/__init__.py": 'raise ImportError("this titan-core is not Titan\'s")\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: titan\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / _stand_in_name(name, version), "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def _install_third_party(python: str, dist: Path) -> None:
    """Every requirement of the seven wheels (the trainer's with its test extra, and the extras
    that asks of its siblings, e.g. titan-llm-ckpt[s3]) but those on titan distributions,
    Titan's own or not: pip resolves those from the index."""
    requires: dict[str, list[Requirement]] = {}
    for wheel in sorted(dist.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
            lines = archive.read(metadata).decode().splitlines()
        name = canonicalize_name(next(ln[5:].strip() for ln in lines if ln.startswith("Name:")))
        requires[name] = [
            Requirement(ln.split(":", 1)[1].strip())
            for ln in lines
            if ln.startswith("Requires-Dist:")
        ]
    extras = {name: {""} for name in requires}
    extras[TRAINER].add("test")

    def active(name: str) -> list[Requirement]:
        return [
            r
            for r in requires[name]
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in extras[name])
        ]

    changed = True
    while changed:  # the extras titan distributions ask of each other, to a fixed point
        changed = False
        for name in requires:
            for req in active(name):
                wanted = canonicalize_name(req.name)
                if wanted in extras and not set(req.extras) <= extras[wanted]:
                    extras[wanted] |= set(req.extras)
                    changed = True
    requirements = []
    for name in requires:
        for req in active(name):
            if canonicalize_name(req.name).startswith("titan"):  # for pip, from the index
                continue
            req.marker = None
            requirements.append(str(req))
    run(["uv", "pip", "install", "--quiet", "--python", python, "pip", *sorted(set(requirements))])


def _pip(python: str, url: str, args: list[str]) -> None:
    """pip with `url` as its only index: no configuration file, no PIP_* variable, no cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    run(
        [python, "-m", "pip", *args[:1], "--index-url", url + "simple/", "--no-cache-dir",
         "--disable-pip-version-check", "--no-input", "--quiet", *args[1:]],
        env=env,
    )  # fmt: skip


def _report_problems(report: dict, url: str) -> list[str]:
    installed = {
        canonicalize_name(item["metadata"]["name"]): item["download_info"]["url"]
        for item in report["install"]
    }
    problems = []
    if set(installed) != DISTRIBUTIONS:
        problems.append(
            f"pip installed {sorted(installed)}, not exactly Titan's seven distributions "
            "(everything else was there already)"
        )
    for name, source in sorted(installed.items()):
        if not source.startswith(url):
            problems.append(f"{name} came from {source}, not from the local index {url}")
    versions = {
        canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
        for item in report["install"]
    }
    for folder in members():
        meta = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        if versions.get(meta["name"]) not in (None, meta["version"]):
            problems.append(f"{meta['name']} {versions[meta['name']]} is not {meta['version']}")
    return problems


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
