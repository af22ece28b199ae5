"""The configs and launch scripts ship with titan-trainer and are found by name from any folder,
whether titan-trainer is the workspace's editable install or a wheel in a clean venv (`nox -s
packaging` runs this file against the built wheel). The launch scripts run for real, with only
the cluster tools (torchrun, srun, scontrol) replaced by recorders, since there is no cluster."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from titan_core import ConfigError
from titan_trainer.shipped import LAUNCH_SCRIPTS, find_config_file, shipped_configs, shipped_root

TRAINER = Path(__file__).resolve().parents[1]  # apps/trainer: the files as they are edited
BIN = Path(sys.executable).parent


def test_every_config_and_launch_script_ships_unchanged():
    edited = {p.stem: p for p in (TRAINER / "configs").glob("*.toml")}
    assert set(shipped_configs()) == set(edited) >= {"debug_model", "llama3_8b", "llama3_70b"}
    for name, path in shipped_configs().items():
        assert path.read_bytes() == edited[name].read_bytes(), name
    for script in LAUNCH_SCRIPTS:
        assert (shipped_root() / script).read_bytes() == (TRAINER / script).read_bytes(), script


def test_a_config_name_finds_the_shipped_file_unless_such_a_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    debug = shipped_configs()["debug_model"]
    for given in ("debug_model", "debug_model.toml", "configs/debug_model.toml"):
        assert find_config_file(given) == debug, given
    (tmp_path / "debug_model.toml").write_text("[training]\nsteps = 3\n")
    assert find_config_file("debug_model.toml") == Path("debug_model.toml")  # the user's own
    with pytest.raises(ConfigError, match="did you mean debug_model"):
        find_config_file("debug_modle")
    with pytest.raises(ConfigError, match="ships no config of that name"):
        find_config_file("elsewhere/debug_model.toml")  # a path, not a name: no guessing


def test_list_configs_and_config_path_answer_without_importing_torch(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        from titan_trainer.cli import main
        main(["--list-configs"])
        main(["--config-path", "llama3_8b"])
        assert "torch" not in sys.modules, "imported torch"
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == str(shipped_configs()["llama3_8b"].resolve())
    for name in shipped_configs():
        assert any(line.split()[:1] == [name] for line in lines), name
    assert str(shipped_root() / "scripts/multinode.sbatch") in done.stdout


def test_the_readme_runs_a_shipped_config_by_name_from_any_folder(tmp_path):
    readme = (TRAINER / "README.md").read_text()
    lines = readme.splitlines()
    command = "titan-train --job.config_file debug_model --training.steps 5"
    assert command in lines
    twice = [line for line in lines if line.startswith(f"{command} --job.dump_folder")]
    assert len(twice) == 2, twice
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "2"}

    def run(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            shlex.split(line.split("  #")[0]), cwd=tmp_path, capture_output=True, text=True,
            timeout=600, env=env,
        )  # fmt: skip

    done = run(command)
    assert done.returncode == 0, done.stderr
    assert "step    5 | loss" in done.stdout
    # Nothing before Titan's own first line: no torchao notice in a run without Float8.
    assert "register_constant() on Enum subclasses" not in done.stderr, done.stderr[:2000]
    # Outputs land under the folder it ran in, with the name it was given.
    assert 'config_file = "debug_model"' in (tmp_path / "outputs/debug/config.toml").read_text()
    assert {p.name for p in (tmp_path / "outputs/debug/plots").iterdir()} == {
        "loss.png", "throughput.png", "memory.png",
    }  # fmt: skip
    assert (tmp_path / "outputs/debug/logs/rank_0.log").is_file()
    # The README's comparison: the same job twice (side by side), and titan-compare on the two.
    (compare,) = [line for line in lines if line.startswith("titan-compare ")]
    started = [
        subprocess.Popen(shlex.split(line), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
        for line in twice
    ]  # fmt: skip
    for proc in started:
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
    done = run(compare)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "within tolerance 1e-05: loss" in done.stdout
    # The plot goes beside the runs, not into the folder the command was typed in.
    assert "plot: outputs/first/compare.png" in done.stdout
    assert (tmp_path / "outputs/first/compare.png").stat().st_size > 10_000
    assert not (tmp_path / "compare.png").exists()


def _recorder(folder: Path, name: str, body: str = "") -> Path:
    """A stand-in for a cluster tool: does `body`, else writes its arguments to $RECORD."""
    path = folder / name
    path.write_text(
        f'#!/usr/bin/env bash\n{body}\nprintf "%s\\n" "$@" > "$RECORD"\n'
        'echo "LOG_RANK=${LOG_RANK:-} TITAN_DATA_CHECKED=${TITAN_DATA_CHECKED:-}" > "$RECORD.env"\n'
    )
    path.chmod(0o755)
    return path


def _launch(script: str, args: list[str], cwd: Path, tmp_path: Path, **env: str):
    """Run a launch script with the cluster tools recorded. For run_train.sh, PYTHON is a
    python whose `-m torch.distributed.run` (torchrun) is recorded and whose `--check` (the
    checks before the ranks start, run for real by the tests of the README's commands) is
    recorded and passes."""
    tools = tmp_path / "cluster-tools"
    tools.mkdir(exist_ok=True)
    python = _recorder(
        tools,
        "python-recorded",
        'if [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2; set -- torchrun "$@";\n'
        f'elif [[ " $* " == *" --check "* ]]; then echo "$@" > "$RECORD.check"; exit 0;\n'
        f'else exec {sys.executable} "$@"; fi',
    )
    # SLURM's node list, and the first node's address as SLURM reaches it (NodeAddr).
    _recorder(
        tools,
        "scontrol",
        'if [ "$1 $2" = "show node" ]; then echo "NodeName=$3 NodeAddr=10.1.2.3 NodeHostName=$3";'
        " else echo node1; echo node2; fi; exit 0",
    )
    # srun starts titan_trainer.launch on every node.
    _recorder(tools, "srun")
    record = tmp_path / "launched"
    for old in (record, Path(f"{record}.check")):
        old.unlink(missing_ok=True)
    done = subprocess.run(
        ["bash", str(shipped_root() / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PATH": f"{tools}:{BIN}:{os.environ['PATH']}",
            "RECORD": str(record),
            "PYTHON": str(python),
            **env,
        },
    )
    launched = record.read_text().splitlines() if record.exists() else None
    return done, launched


def _config_arg(launched: list[str]) -> str:
    return launched[launched.index("--job.config_file") + 1]


def test_run_train_sh_finds_the_config_from_any_folder(tmp_path):
    llama8b = str(shipped_configs()["llama3_8b"].resolve())
    for given in ("configs/llama3_8b.toml", "llama3_8b"):  # the README's spelling, and the name
        done, launched = _launch(
            "run_train.sh", ["--training.steps", "100"], tmp_path, tmp_path,
            NGPU="8", CONFIG_FILE=given,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert _config_arg(launched) == llama8b
        assert "--nproc_per_node=8" in launched and launched[-2:] == ["--training.steps", "100"]
    # The README's LOG_RANK line: titan-train (under torchrun) reads it from the environment.
    (line,) = [
        x for x in (TRAINER / "README.md").read_text().splitlines() if x.startswith("LOG_RANK=")
    ]
    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if "=" not in w)
    assignments, script, args = words[:at], words[at], words[at + 1 :]
    done, launched = _launch(
        "run_train.sh", args, tmp_path, tmp_path, **dict(a.split("=", 1) for a in assignments)
    )
    assert done.returncode == 0, done.stderr
    assert script == "apps/trainer/run_train.sh" and "--nproc_per_node=2" in launched
    # The checks ran once, for the job's 2 processes, before torchrun; the ranks skip the data.
    assert (tmp_path / "launched.env").read_text() == "LOG_RANK=0,1 TITAN_DATA_CHECKED=1\n"
    assert (tmp_path / "launched.check").read_text().startswith("-m titan_trainer --check")
    own = tmp_path / "mine.toml"
    own.write_text("[training]\nsteps = 2\n")
    done, launched = _launch(
        "run_train.sh", [], tmp_path, tmp_path, NGPU="1", CONFIG_FILE="mine.toml"
    )
    assert _config_arg(launched) == str(own.resolve())
    done, launched = _launch("run_train.sh", [], tmp_path, tmp_path, NGPU="1", CONFIG_FILE="nope")
    assert done.returncode != 0 and launched is None  # refused before torchrun
    assert "ships no config of that name" in done.stderr


def test_multinode_sbatch_resolves_the_config_in_the_submission_folder(tmp_path):
    # sbatch runs a spool copy of the script in the submission folder; run it from elsewhere.
    submitted_from = tmp_path / "project"
    submitted_from.mkdir()
    slurm = {
        "SLURM_SUBMIT_DIR": str(submitted_from),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "42",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_ON_NODE": "96",
        "TMPDIR": str(tmp_path),
    }
    spool = tmp_path / "spool"
    spool.mkdir()
    # The root README's command: `... multinode.sbatch configs/llama3_70b.toml` from the repo
    # root, where there is no configs/ folder; it names the shipped config.
    done, launched = _launch(
        "scripts/multinode.sbatch",
        ["configs/llama3_70b.toml", "--training.steps", "10"],
        spool,
        tmp_path,
        **slurm,
    )
    assert done.returncode == 0, done.stderr
    at = launched.index("-m")
    assert Path(launched[at - 1]).name == "python-recorded"  # PYTHON, the same path everywhere
    assert "--kill-on-bad-exit=1" in launched[:at] and "--cpus-per-task=96" in launched[:at]
    # Each node's launcher, a process per GPU SLURM gave the node, the rendezvous at the first
    # node's address as SLURM knows it.
    assert launched[at + 1 : at + 6] == [
        "titan_trainer.launch", "--nnodes", "2", "--nproc-per-node", "8"
    ]  # fmt: skip
    assert launched[launched.index("--master-addr") + 1] == "10.1.2.3"
    assert launched[launched.index("--node-names") + 1] == "node1,node2"
    assert _config_arg(launched) == str(shipped_configs()["llama3_70b"].resolve())
    assert launched[-2:] == ["--training.steps", "10"]
    # The checks ran once, for the job's 2 x 8 processes, before any node started a rank.
    assert "2 node(s) x 8 process(es) (the GPUs SLURM gave each node) = 16" in done.stderr
    # A user's own TOML, relative to the submission folder, arrives as an absolute path.
    (submitted_from / "ours.toml").write_text("[training]\nsteps = 2\n")
    done, launched = _launch("scripts/multinode.sbatch", ["ours.toml"], spool, tmp_path, **slurm)
    assert _config_arg(launched) == str((submitted_from / "ours.toml").resolve())
    done, launched = _launch("scripts/multinode.sbatch", ["nope.toml"], spool, tmp_path, **slurm)
    assert done.returncode != 0 and launched is None  # refused before any srun
    assert "ships no config of that name" in done.stderr
