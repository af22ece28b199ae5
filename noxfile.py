"""The one entry point for checks. `uv run nox` runs the default set, which is what CI runs.

    uv run nox -l                          # list sessions
    uv run nox -s tests-titan-core         # one package's tests in the workspace env
    uv run nox -s isolated-titan-parallel  # build the wheel, install it alone, test it there
    uv run nox -s packaging                # publish to a local index, install from it, check
    uv run nox -t compat                   # lowest/highest torch x oldest/newest Python
    uv run nox -s bench                    # benchmarks (not in the default set)
    uv run nox -s gpu                      # the GPU suite (tests marked gpu; one CUDA GPU)
    uv run nox -s slow                     # tests marked slow (not in the default set)
    uv run nox -s cluster                  # the multi-node tests on a real SLURM test cluster
    uv run nox -s tests-avx2               # the default tests as on an AVX2-only CPU
    uv run nox -s vs-torchtitan            # bench/vs_torchtitan.py's CPU checks (torchtitan 0.2.2)

Workspace sessions reuse the uv workspace environment (`uv run --frozen`) instead of building
a venv of their own: torch is large and the lock already pins it. Isolated sessions build
real wheels and install them into a clean venv, the way a user gets them from an index.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Each package by its short name (its folder, its sessions' names, its module with `_`), and
# where it lives. Its distribution name, on the package index, is its pyproject's `name`:
# titan-llm-core for titan-core, and so on (docs/architecture.md, "Packaging").
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
DURATIONS = 25
# Test processes compute on one thread each (the processes they start inherit it): at test
# sizes a second thread mostly waits at OpenMP's barriers, and on a loaded machine it burns
# the CPU spinning there (a test's generation step measured 14x the CPU time on two threads:
# 13.3 s against 0.9 s, at load 20 on 2 cores). Tests that start several processes run side
# by side on the cores instead.
TEST_ENV = {"OMP_NUM_THREADS": "1"}

# The trainer's tests mostly wait on one single-threaded process (a CLI run, a launch), which
# left the second core of a 2-core machine idle half of the suite (measured with vmstat): they
# run in one pytest-xdist worker per core (at most 4, as their launches start up to 4 ranks
# each), a file's tests in one worker so that its module fixtures run once (27.8 -> 20.2 min
# on 2 cores). titan-parallel's and titan-ckpt's gain less (4:08 -> 3:59, 59 -> 43 s: their
# slowest tests are 2-rank launches that fill both cores already); the smaller suites would
# spend on starting workers (each imports torch) what they gain.
XDIST = "pytest-xdist>=3.5,<4"
_WORKERS = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]
PARALLEL = {name: _WORKERS for name in ("titan-trainer", "titan-parallel", "titan-ckpt")}

# Importing torch is several seconds faster with cached bytecode; some environments switch the
# cache off, which every test process would then pay again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "layers",
    "release",
    "packaging",
    "oldest-siblings",
    *(f"isolated-{p}" for p in LIBRARIES),
    "tests-titan-trainer",
    "cluster",
    "summary",
]
nox.options.reuse_existing_virtualenvs = True


def _module(package: str) -> str:
    return package.replace("-", "_")


def _project(package: str) -> dict:
    return tomllib.loads((ROOT / PACKAGES[package] / "pyproject.toml").read_text())["project"]


def _distribution(package: str) -> str:
    """The distribution name of a package (its short name's `titan-llm-` form)."""
    return _project(package)["name"]


def _wheel(folder: Path, package: str) -> Path:
    """The one wheel of `package` built into `folder`."""
    return next(folder.glob(f"{_distribution(package).replace('-', '_')}-*.whl"))


# Tests marked slow (the same check at a larger size) run in `nox -s slow`; those marked
# cluster (a SLURM cluster started on this machine) in `nox -s cluster`.
DEFAULT_MARKERS = "not slow and not cluster"


def _pytest_args(session: nox.Session, dist: str, markers: str = DEFAULT_MARKERS) -> list[str]:
    JUNIT.mkdir(parents=True, exist_ok=True)
    return [
        str(ROOT / PACKAGES[dist] / "tests"),
        f"--junitxml={JUNIT / session.name}.xml",
        "-q",
        # The slowest tests, so that CI time stays visible where it goes.
        f"--durations={DURATIONS}",
        "-m",
        markers,
        *session.posargs,
    ]


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.run("uv", "run", "--frozen", "ruff", "check", ".")
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def layers(session: nox.Session) -> None:
    """The dependency rules of docs/architecture.md ("Layers"): import contracts and declared
    dependencies."""
    session.run("uv", "run", "--frozen", "lint-imports")
    session.run("uv", "run", "--frozen", "python", "tools/check_declared_deps.py")


@nox.session(venv_backend="none")
def release(session: nox.Session) -> None:
    """The release process's checks (docs/releasing.md, tools/release.py): each version is the
    newest release of its CHANGELOG, a public API that changed since it has an Unreleased
    entry (so the next release moves the version), and every requirement on a sibling follows
    what the package uses of it."""
    session.run("uv", "run", "--frozen", "python", "tools/release.py", "check")


@nox.session(name="oldest-siblings")
def oldest_siblings(session: nox.Session) -> None:
    """Each package's tests against its siblings' oldest allowed releases (the lower bounds of
    its requirements), built from their release commits, where one is older than the
    workspace's; a package whose bounds allow only the workspace's siblings is said to be
    covered by its isolated session, which installs exactly those."""
    for dist in PACKAGES:
        oldest = _oldest_siblings(dist)
        older = {name: release for name, release in oldest.items() if release[1] is not None}
        if not older:
            covered = f"isolated-{dist}" if dist in LIBRARIES else f"tests-{dist}"
            session.log(
                f"{dist}: every sibling's oldest allowed release is the workspace's"
                f" ({', '.join(f'{n} {v}' for n, (v, _) in oldest.items()) or 'no siblings'});"
                f" {covered} tests it with exactly those"
            )
            continue
        wheels = Path(session.create_tmp()) / f"oldest-{dist}"
        shutil.rmtree(wheels, ignore_errors=True)
        for name, (version, commit) in older.items():
            session.log(f"{dist}: {name} {version} from its release commit {commit[:12]}")
            _build_at_commit(session, name, commit, wheels)
        _isolated(session, dist, pins=(), prebuilt=wheels)


def _oldest_siblings(dist: str) -> dict[str, tuple[str, str | None]]:
    """{sibling distribution: (oldest allowed version, its release commit or None when it is
    the workspace's)} for package `dist` (tools/release.py oldest)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "release.py"), "oldest", _distribution(dist)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    out = {}
    for line in done.stdout.splitlines():
        name, version, commit = line.split()
        out[name] = (version, None if commit == "working-tree" else commit)
    return out


def _build_at_commit(session: nox.Session, dist: str, commit: str, out: Path) -> None:
    """The wheel of distribution `dist` as its sources were at `commit`."""
    folder = next(PACKAGES[p] for p in PACKAGES if _distribution(p) == dist)
    tree = Path(session.create_tmp()) / f"src-{commit[:12]}"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit, folder], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    session.run(
        "uv", "build", "--wheel", "--quiet", "--out-dir", str(out), str(tree / folder),
        external=True,
    )  # fmt: skip


# Tests the default set runs in another session already, where they check more: `packaging`
# runs the README's by-name commands against the installed wheel (three debug-model trainings,
# 30 s or more), the path a user of `pip install` takes.
ELSEWHERE = {
    "titan-trainer": [
        "--deselect",
        "apps/trainer/tests/test_shipped_files.py"
        "::test_the_readme_runs_a_shipped_config_by_name_from_any_folder",
    ]
}

for _dist in PACKAGES:

    @nox.session(name=f"tests-{_dist}", venv_backend="none")
    def tests(session: nox.Session, dist: str = _dist) -> None:
        """One package's tests in the workspace environment."""
        args = [*PARALLEL.get(dist, []), *ELSEWHERE.get(dist, []), *_pytest_args(session, dist)]
        session.run("uv", "run", "--frozen", "pytest", *args, env=TEST_ENV)


for _dist in PACKAGES:

    @nox.session(name=f"isolated-{_dist}")
    def isolated(session: nox.Session, dist: str = _dist) -> None:
        """Build the wheel (no workspace sources), install it alone with its dependencies into a
        clean venv, show that no other titan package is importable, and run its tests there."""
        _isolated(session, dist)


def _isolated(
    session: nox.Session, dist: str, pins: tuple[str, ...] = (), prebuilt: Path | None = None
) -> None:
    """`dist`'s wheel and the titan wheels it needs in the session's venv, with `pins` (extra
    requirements such as a torch version) resolved together with them; then its tests. A
    titan wheel in `prebuilt` (a sibling's older release) is installed instead of building
    the workspace's."""
    wheels = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    needed = _titan_closure(dist)
    given = {w.name.split("-")[0]: w for w in prebuilt.glob("*.whl")} if prebuilt else {}
    for name in needed:
        if _distribution(name).replace("-", "_") in given and name != dist:
            continue
        session.run(
            "uv",
            "build",
            "--no-sources",
            "--wheel",
            "--quiet",
            "--package",
            _distribution(name),
            "--out-dir",
            str(wheels),
            external=True,
        )
    built = {
        name: given.get(_distribution(name).replace("-", "_")) or _wheel(wheels, name)
        for name in needed
    }
    # Siblings are not on the index yet, so their freshly built wheels stand in for it.
    workers = [XDIST] if dist in PARALLEL else []
    session.install(
        f"{built[dist]}[test]", *(str(built[n]) for n in needed if n != dist), *workers, *pins
    )
    if pins:
        session.run("python", "-c", _VERSIONS, *_WATCHED, *(_requirement_name(p) for p in pins))
    others = [_module(p) for p in PACKAGES if p not in needed]
    session.run(
        "python",
        "-c",
        "import importlib.util, sys; present = [m for m in sys.argv[1:] if importlib.util.find_spec(m)];"
        " assert not present, f'unexpected titan packages importable: {present}';"
        " print('isolated: no other titan package importable')",
        *others,
    )
    _pytest_outside_the_repo(session, *PARALLEL.get(dist, []), *_pytest_args(session, dist))


# What a compatibility run records: the Python and these, where installed.
_WATCHED = ("torch", "torchao", "datasets", "transformers", "numpy")
_VERSIONS = (
    "import importlib.metadata as m, importlib.util as u, sys; print('installed: python',"
    " sys.version.split()[0], *(f'{d} {m.version(d)}' for d in dict.fromkeys(sys.argv[1:])"
    " if u.find_spec(d)))"
)


def _pytest_outside_the_repo(session: nox.Session, *args: str) -> None:
    """pytest in the session's venv, run from outside the repo so that only the installed
    wheels can be imported (no source folder on sys.path)."""
    session.chdir(session.create_tmp())
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={ROOT}", *args,
        env=TEST_ENV,
    )  # fmt: skip


def _requirement_name(requirement: str) -> str:
    return requirement.split("=")[0].split("<")[0].split(">")[0].strip()


def _titan_closure(package: str) -> list[str]:
    """The titan packages `package` needs (itself first), read from the pyprojects."""
    by_dist = {_distribution(p): p for p in PACKAGES}
    order, todo = [], [package]
    while todo:
        name = todo.pop()
        if name in order:
            continue
        order.append(name)
        for req in _project(name).get("dependencies", []):
            dep = req.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip()
            if dep in by_dist:
                todo.append(by_dist[dep])
    return order


@nox.session
def packaging(session: nox.Session) -> None:
    """Build every wheel and sdist as an index would get them; publish them to a package index
    on the loopback and `pip install titan-llm-trainer[test]` into this clean venv by name from
    it (tools/check_publish.py: twine check --strict, twine upload to pypiserver, every titan
    distribution from that index, never the foreign `titan-core`); check what they carry
    (tools/check_packaging.py); then run, from outside the repo, what only an installed wheel
    shows: titan-trainer's shipped configs and launch scripts, and the packaging checks' own
    tests."""
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run(
        "uv", "build", "--all-packages", "--no-sources", "--quiet", "--out-dir", str(dist),
        external=True,
    )  # fmt: skip
    # Reused venvs keep what an earlier run installed: start from an empty one.
    session.run("uv", "pip", "uninstall", "--quiet", *(_distribution(p) for p in PACKAGES),
                "titan-core", external=True, silent=True, success_codes=[0, 1, 2])  # fmt: skip
    python = str(Path(session.virtualenv.location) / "bin" / "python")
    # The workspace's interpreter (nox's own: `uv run nox`) holds twine and pypiserver; `uv run`
    # here would sync the workspace into this session's venv.
    session.run(
        sys.executable, str(ROOT / "tools" / "check_publish.py"), str(dist), python,
        external=True,
    )  # fmt: skip
    session.run("python", str(ROOT / "tools" / "check_packaging.py"), str(dist))
    JUNIT.mkdir(parents=True, exist_ok=True)
    _pytest_outside_the_repo(
        session,
        str(ROOT / "apps/trainer/tests/test_shipped_files.py"),
        str(ROOT / "tools"),
        # bench/README.md's torchtitan bundle commands run here; the CPU checks and the smoke
        # run (a minute and a half) in their own session, vs-torchtitan.
        *(
            f"--deselect=tools/test_vs_torchtitan.py::{name}"
            for name in (
                "test_the_cpu_checks_pass_from_the_bundle",
                "test_smoke_trains_titan_and_runs_torchtitan_to_its_cuda_device",
            )
        ),
        f"--junitxml={JUNIT / 'packaging'}.xml",
        "-q",
        *session.posargs,
    )


# The compatibility matrix: each library's isolated tests on the lowest and the highest torch
# its pyproject admits, on Python 3.11 and the newest Python torch supports that this machine
# has (`uv run nox -t compat`, or one session by name). Not in the default set: it downloads a
# torch build per Python (several GB on a fresh machine) and takes longer than the default set;
# docs/compatibility.md records its last run.
COMPAT_PYTHONS = ("3.11", "3.13")


# Cached: the compat sessions below are defined for every library and torch end (24 of them),
# and each probe starts an interpreter, which every `nox` command paid for each one (36
# starts, 7 s on a loaded 2-core machine) before running any session.
@functools.cache
def _interpreter(version: str) -> str:
    """An interpreter for `version`: pythonX.Y on PATH, else one that pyenv installed without
    activating it (uv does not look there); else the version, for uv to look up itself."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return str(candidate)
    return version


def _torch_pin(end: str) -> str:
    """`torch==<lowest>.*` or the declared range itself (resolved to its newest release),
    from titan-core's pyproject, which every library shares."""
    (spec,) = [r for r in _project("titan-core")["dependencies"] if r.startswith("torch")]
    if end == "highest":
        return spec
    lowest = spec.split(">=")[1].split(",")[0].strip()
    return f"torch=={lowest}.*"


for _dist in LIBRARIES:
    for _python in COMPAT_PYTHONS:
        for _end in ("lowest", "highest"):

            @nox.session(
                name=f"compat-{_dist}-py{_python}-torch-{_end}",
                python=_interpreter(_python),
                tags=["compat", f"compat-py{_python}", f"compat-torch-{_end}"],
            )
            def compat(session: nox.Session, dist: str = _dist, end: str = _end) -> None:
                """One library's isolated tests with the lowest or the highest supported torch."""
                # uv reads no pip configuration: a local folder of wheels that pip is told to
                # use (a CPU torch build, say) is passed on explicitly.
                links = [
                    p for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir()
                ]
                if links:
                    session.env["UV_FIND_LINKS"] = " ".join(links)
                _isolated(session, dist, pins=(_torch_pin(end),))


@nox.session(venv_backend="none")
def cluster(session: nox.Session) -> None:
    """The multi-node tests (marked `cluster`, apps/trainer/tests/test_cluster_*.py) on a real
    SLURM cluster that they start on this machine with tools/slurm_cluster.py: slurmctld, and a
    slurmd per node in the node's own network namespace. Needs root, network namespaces and
    Debian's slurm-wlm and munge (`.ci/run` installs them where it runs as root); elsewhere each
    test is reported skipped with the reason. Its three files run side by side, one cluster
    each: much of a cluster test is waiting (on SLURM, on a timeout it checks), so three
    workers share two cores well."""
    workers = ["-n", "3", "--dist", "loadfile"]
    args = [*workers, *_pytest_args(session, "titan-trainer", "cluster")]
    session.run("uv", "run", "--frozen", "pytest", *args, "-rs", env=TEST_ENV)


@nox.session(venv_backend="none")
def summary(session: nox.Session) -> None:
    """Add up the test results of the sessions that ran before it, and list the slowest tests
    across all of them (tools/junit_summary.py); then clear the results for the next run."""
    paths = sorted(JUNIT.glob("*.xml"))
    try:  # exit status 1 (the session fails) when a test failed or none ran
        session.run(
            sys.executable, str(ROOT / "tools" / "junit_summary.py"), *map(str, paths),
            f"--slowest={DURATIONS}", external=True,
        )  # fmt: skip
    finally:
        for path in paths:
            path.unlink()


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks (JSON lines on stdout). Not in the default set: timings need a quiet machine."""
    for script in sorted((ROOT / "bench").glob("*.py")):
        if script.name in ("gpu.py", "vs_torchtitan.py"):  # GPU only: bench-gpu, vs-torchtitan
            continue
        # The workspace's interpreter (nox's own: `uv run nox`): `uv run` would check the
        # workspace's sync once per script again.
        session.run(
            sys.executable, str(script), *session.posargs,
            env={"PYTHONUNBUFFERED": "1", **os.environ}, external=True,
        )  # fmt: skip


@nox.session(name="bench-gpu", venv_backend="none")
def bench_gpu(session: nox.Session) -> None:
    """Every GPU benchmark (1B throughput, Float8, async TP, checkpoints) into one JSON-lines file
    (bench/gpu.py); on a machine without a CUDA GPU it says so and fails."""
    session.run(
        "uv",
        "run",
        "--frozen",
        "python",
        str(ROOT / "bench" / "gpu.py"),
        *session.posargs,
        env={"PYTHONUNBUFFERED": "1", **os.environ},
    )


@nox.session(name="vs-torchtitan", venv_backend="none")
def vs_torchtitan(session: nox.Session) -> None:
    """bench/vs_torchtitan.py (Titan against torchtitan 0.2.2) from a bundle made with
    `tools/gpu_bundle.py --with-torchtitan`, as far as this machine takes it
    (tools/test_vs_torchtitan.py: `--check`, and `--smoke`, which on a CPU trains Titan and runs
    torchtitan to its CUDA device). Downloads torchtitan and its dependencies from PyPI. The
    measurement itself, on a GPU machine: `bash gpu-bundle/run_vs_torchtitan.sh`."""
    session.run(
        "uv", "run", "--frozen", "pytest", str(ROOT / "tools" / "test_vs_torchtitan.py"), "-q",
        f"--durations={DURATIONS}", *session.posargs, env=TEST_ENV,
    )  # fmt: skip


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU suite: every test marked `gpu`, of every package, in the workspace env (one
    CUDA GPU: the README's main job, each shipped config shrunk to fit it, Float8, MoE,
    validation, generation, memory). Without a GPU each is reported skipped with its reason.
    Where torch is preinstalled and nothing can be downloaded: tools/gpu_bundle.py."""
    _marked(session, "gpu", "-rs")


@nox.session(venv_backend="none")
def slow(session: nox.Session) -> None:
    """The tests marked `slow`, of every package, in the workspace env (not in the default set):
    checks the default suite runs at a smaller size, at the size their claim is about (the
    sharded Hugging Face import/export of a 313 MB model on 4 ranks)."""
    _marked(session, "slow", "-s")


def _marked(session: nox.Session, marker: str, *options: str) -> None:
    """The tests marked `marker`, of every package, in the workspace env."""
    for dist in PACKAGES:
        session.run(
            "uv", "run", "--frozen", "pytest", str(ROOT / PACKAGES[dist] / "tests"), "-m", marker,
            *options, f"--durations={DURATIONS}", *session.posargs,
            success_codes=[0, 5],  # 5: none of this package's tests is marked `marker`
        )  # fmt: skip


# What an AVX2-only CPU (no AVX-512, no bf16 instructions) runs, forced on any x86 CPU: torch's
# own kernels dispatch to AVX2 (ATEN_CPU_CAPABILITY, which titan_core.supports_bf16 reads too)
# and oneDNN's matmuls use no ISA above it (ONEDNN_MAX_CPU_ISA).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@nox.session(name="tests-avx2", venv_backend="none")
def tests_avx2(session: nox.Session) -> None:
    """Every package's default tests as on an AVX2-only CPU (AVX2_ENV), in the workspace env.
    Not in the default set (it repeats it); run it where CI's machines may lack AVX-512 or bf16
    and the machine at hand has them. `uv run nox -s tests-avx2 -- -k bench` narrows it."""
    session.run("uv", "run", "--frozen", "python", "-c", _CAPABILITY, env=AVX2_ENV)
    # Inductor's own cache for this session: kernels compiled for the CPU's full ISA by other
    # runs are not reused here.
    inductor_cache = {"TORCHINDUCTOR_CACHE_DIR": str(Path(session.create_tmp()) / "inductor")}
    for dist in PACKAGES:
        session.run(
            "uv", "run", "--frozen", "pytest", *PARALLEL.get(dist, []),
            str(ROOT / PACKAGES[dist] / "tests"), "-q", "-m", DEFAULT_MARKERS,
            f"--durations={DURATIONS}", *session.posargs,
            env={**TEST_ENV, **AVX2_ENV, **inductor_cache},
            success_codes=[0, 5],  # 5: -k selected none here
        )  # fmt: skip


_CAPABILITY = (
    "import torch, titan_core; c = torch.backends.cpu.get_cpu_capability();"
    " print('torch dispatches to', c, '| native bf16:', titan_core.supports_bf16(torch.device('cpu')));"
    " assert c in ('AVX2', 'DEFAULT'), c"
)


@nox.session(name="dryrun-405b", venv_backend="none")
def dryrun_405b(session: nox.Session) -> None:
    """The 405B config's dry run at 512 ranks with every pipeline rank simulated (the default
    suite simulates the first and the last; see the trainer README for times)."""
    _titan_dry_run(session, "llama3_405b", "--dry_run.all_ranks")


@nox.session(name="dryrun-moe", venv_backend="none")
def dryrun_moe(session: nox.Session) -> None:
    """The dry runs of the large mixture-of-experts configs at their world sizes, each with
    expert parallel (Qwen3-235B-A22B, DeepSeek-V3 236B and 671B, Llama 4 Scout and Maverick,
    GPT-OSS 20B and 120B, Kimi K2 1T;
    one to three minutes each on a 2-core CPU). The default suite checks their configs and
    their splits at full size without simulating a step (see the trainer README)."""
    for name in MOE_DRY_RUNS:
        _titan_dry_run(session, name)


def _titan_dry_run(session: nox.Session, config: str, *flags: str) -> None:
    """`titan-train --dry-run` of a shipped config, with the session's arguments last."""
    session.run(
        "uv",
        "run",
        "--frozen",
        "titan-train",
        "--job.config_file",
        f"apps/trainer/configs/{config}.toml",
        "--dry-run",
        *flags,
        *session.posargs,
        env={"PYTHONUNBUFFERED": "1", **os.environ},
    )


@nox.session(name="dryrun-torchtitan", venv_backend="none")
def dryrun_torchtitan(session: nox.Session) -> None:
    """The dry run of each TOML written the way torchtitan v0.2.2 wrote its train configs
    (apps/trainer/tests/torchtitan_configs), at the world size its `# titan dry run:` line
    names, from a folder laid out as torchtitan's checkout (its tests/assets/c4_test). The
    default suite runs their checks (tests/test_torchtitan_configs.py); this simulates the
    ones that pass them. Exit 3 (does not fit) is reported, not an error."""
    import shlex

    folder = ROOT / "apps/trainer/tests/torchtitan_configs"
    work = Path(session.create_tmp())
    sample = work / "tests/assets/c4_test"
    sample.mkdir(parents=True, exist_ok=True)
    (sample / "data.json").write_text('{"text": "A local sample document."}\n' * 100)
    session.chdir(work)
    names = session.posargs or [p.stem for p in sorted(folder.glob("*.toml"))]
    for name in names:
        path = folder / f"{name}.toml"
        line = next(x for x in path.read_text().splitlines() if x.startswith("# titan dry run:"))
        session.run(
            "uv", "run", "--frozen", "--project", str(ROOT), "titan-train",
            "--job.config_file", str(path), "--dry-run", "--dry_run.suggest", "false",
            *shlex.split(line.removeprefix("# titan dry run:")),
            success_codes=[0, 2, 3],
            env={"PYTHONUNBUFFERED": "1", **os.environ},
        )  # fmt: skip


MOE_DRY_RUNS = (
    "qwen3_235b_a22b",
    "deepseek_v3_236b",
    "deepseek_v3_671b",
    "llama4_scout",
    "llama4_maverick",
    "gpt_oss_20b",
    "gpt_oss_120b",
    "kimi_k2_1t",
)
