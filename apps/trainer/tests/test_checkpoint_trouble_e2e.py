"""Checkpoint trouble through the command a user types ends in one message that names the
problem, the folder and the fix, never a traceback: corrupt checkpoints (the one asked for, or
all of them), checkpoints that cannot fit on the disk (before training), a disk that fills up
in the middle of a run (the last good checkpoint stays intact), and folders that are files."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_ckpt import checkpoint_problems
from titan_trainer.cli import main as titan_train

DEBUG_TOML = Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        *("--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump)),
        *("--training.seq_len", "64", "--training.local_batch_size", "2"),
        *("--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"),
        *("--metrics.enable_tensorboard", "false", "--metrics.save_plots_folder", ""),
        *extra,
    ]


def _main(args, capsys) -> tuple[int, str, str]:
    code = titan_train(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def _error(err: str) -> list[str]:
    """The trainer's error message, line by line (library warnings may come first)."""
    start = err.find("titan: error: ")
    assert start >= 0, err
    return err[start:].rstrip().splitlines()


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_checkpoints_end_in_one_message_that_says_which_one_to_use(tmp_path, capsys):
    dump = tmp_path / "run"
    code, out, err = _main(
        _args(dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"),
        capsys,
    )
    assert code == 0, out + err
    folder = dump / "checkpoint"
    os.truncate(folder / "step-4" / "__0_0.distcp", 1000)

    code, out, err = _main(
        _args(dump, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.load_step", "4"),
        capsys,
    )
    assert code == 1, out + err
    error = _error(err)
    assert error[0] == (
        "titan: error: the checkpoint asked for with [checkpoint] load_step = 4 in"
        f" {folder} is not usable:"
    ), error
    assert error[1].startswith("         step-4: __0_0.distcp has 1,000 bytes, "), error
    assert error[2].endswith(
        "step-2 passes every check (all its bytes against their checksums): resume from it with"
        " [checkpoint] load_step = 2 (--checkpoint.load_step 2), or -1 for the newest usable"
        " checkpoint"
    ), error
    assert len(error) == 3 and "Traceback" not in err and "| loss" not in out

    _flip_a_byte(folder / "step-2" / "__0_0.distcp")
    code, out, err = _main(_args(dump, "--training.steps", "6", "--checkpoint.enable"), capsys)
    assert code == 1, out + err
    error = _error(err)
    assert error[0] == f"titan: error: no usable checkpoint in {folder}; each was left in place:"
    assert error[1].startswith("         step-4: __0_0.distcp has 1,000 bytes"), error
    assert error[2].startswith(
        "         step-2: __0_0.distcp does not match its xxh3_128 checksum"
    ), error
    assert "move the broken ones away" in error[3] and len(error) == 4
    assert "Traceback" not in err and "| loss" not in out


def test_checkpoints_that_cannot_fit_on_the_disk_stop_the_run_before_training(tmp_path, capsys):
    # Every step saved and every checkpoint kept: far more than any disk here holds.
    code, out, err = _main(
        _args(
            tmp_path / "run",
            *("--training.steps", "100000000", "--checkpoint.enable"),
            *("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"),
        ),
        capsys,
    )
    assert code == 2, out + err
    folder = tmp_path / "run" / "checkpoint"
    assert (
        f"[checkpoint] the checkpoints will not fit on the disk of {folder}: each holds about"
        in err
    )
    assert "this run saves 100000000 (keep_latest_k = 0 keeps every one)" in err
    assert "lower [checkpoint] keep_latest_k" in err
    assert re.search(r"and the disk has [\d.,]+ [KMGT]iB free", err), err
    assert "| loss" not in out and not folder.exists()


@pytest.mark.parametrize("kind", ["file", "link_to_file"])
@pytest.mark.parametrize("which", ["dump", "checkpoint"])
def test_a_folder_that_is_a_file_is_called_that_with_the_fix(tmp_path, capsys, kind, which):
    dump = tmp_path / "run"
    path = dump / "checkpoint" if which == "checkpoint" else dump
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        path.write_text("not a folder")
        problem = "is a regular file, not a folder"
    else:
        (tmp_path / "target").write_text("not a folder")
        path.symlink_to(tmp_path / "target")
        problem = f"is a symbolic link to {tmp_path / 'target'}, a regular file, not a folder"
    code, out, err = _main(_args(dump, "--training.steps", "1", "--checkpoint.enable"), capsys)
    assert code == 1, out + err
    fix = (
        "point --job.dump_folder at another folder"
        if which == "dump"
        else "point --checkpoint.folder at another folder (relative to the dump folder)"
    )
    assert _error(err) == [
        f"titan: error: the {which} folder {path} {problem}",
        f"       move it away, or {fix}",
    ]
    assert "| loss" not in out and (tmp_path / ("target" if kind != "file" else "run")).exists()


# A disk that fills up while the run trains: the checkpoint folder is a small tmpfs mounted in
# a mount namespace of the run's own (nothing is mounted on this machine, and it goes when the
# run ends). Once step 2's checkpoint is saved, a filler file takes every free byte.
FILL_THE_DISK = r"""
mount -t tmpfs -o size=256m tmpfs "$CKPT" || exit 90
"$PYTHON" -m titan_trainer "$@" > "$LOG" 2>&1 &
pid=$!
until grep -q "checkpoint step 2 saved" "$LOG"; do
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
done
cat /dev/zero > "$CKPT/filler" 2>/dev/null
wait $pid
code=$?
rm -f "$CKPT/filler"
cp -a "$CKPT/." "$OUT/"
exit $code
"""


def _in_own_mount_namespace() -> list[str]:
    """`unshare` into a mount namespace of our own, as root or through a user namespace."""
    for command in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        if shutil.which(command[0]) is None:
            break
        probe = subprocess.run([*command, "true"], capture_output=True)
        if probe.returncode == 0:
            return command
    pytest.fail(
        "cannot make a small file system: this test needs `unshare --mount` (root) or"
        " unprivileged user namespaces to mount a tmpfs of its own"
    )


def test_a_disk_that_fills_mid_run_is_one_message_and_the_last_checkpoint_stays_intact(tmp_path):
    ckpt, out = tmp_path / "small-disk", tmp_path / "copied"
    ckpt.mkdir()
    out.mkdir()
    args = _args(
        tmp_path / "run",
        *("--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"),
        *("--checkpoint.keep_latest_k", "1", "--checkpoint.folder", str(ckpt)),
    )
    env = {
        **os.environ,
        "CKPT": str(ckpt),
        "OUT": str(out),
        "LOG": str(tmp_path / "run.log"),
        "PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "2",
    }
    done = subprocess.run(
        [*_in_own_mount_namespace(), "sh", "-c", FILL_THE_DISK, "sh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "run.log").read_text()
    assert done.returncode == 1, f"{shlex.join(args)}\n{done.stderr}\n{log[-3000:]}"
    error = _error(log)
    assert error[0] == (
        "titan: error: checkpoint save at step 4 failed: No space left on device; the previous"
        " checkpoint step-2 stays the newest, untouched"
    ), error
    assert error[1].startswith(
        f"       the checkpoint folder {ckpt} is on a full disk (a checkpoint of this run takes "
    )
    assert error[1].endswith(
        "free space there, lower [checkpoint] keep_latest_k (now 1), or point [checkpoint]"
        " folder at a disk with room; then run the same command again: it resumes from step-2"
    ), error
    assert len(error) == 2 and "Traceback" not in log
    # What the disk held when the run ended: step 2, whole, and nothing half written.
    assert sorted(p.name for p in out.iterdir()) == [".titan.lock", "step-2"]
    assert checkpoint_problems(out / "step-2") == []
    assert list(tmp_path.rglob(".titan-write-test-*")) == []


# A disk that holds two of the run's checkpoints and not three (each 57.4 MiB): a first run
# saves step 2, a second resumes from it with keep_latest_k = 1 to save steps 4 and 6, and
# would hold three at its last save (it keeps step 2, which it resumed from).
RESUME_ON_A_SMALL_DISK = r"""
mount -t tmpfs -o size=150m tmpfs "$CKPT" || exit 90
"$PYTHON" -m titan_trainer "$@" --training.steps 2 > "$LOG.first" 2>&1 || exit 91
"$PYTHON" -m titan_trainer "$@" --training.steps 6 > "$LOG" 2>&1
code=$?
cp -a "$CKPT/." "$OUT/"
exit $code
"""


def test_a_resume_whose_checkpoints_cannot_fit_is_refused_before_it_trains(tmp_path):
    ckpt, out = tmp_path / "small-disk", tmp_path / "copied"
    ckpt.mkdir()
    out.mkdir()
    args = _args(
        tmp_path / "run",
        *("--checkpoint.enable", "--checkpoint.interval", "2"),
        *("--checkpoint.keep_latest_k", "1", "--checkpoint.folder", str(ckpt)),
    )
    env = {
        **os.environ,
        **{"CKPT": str(ckpt), "OUT": str(out), "LOG": str(tmp_path / "run.log")},
        **{"PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"},
    }
    done = subprocess.run(
        [*_in_own_mount_namespace(), "sh", "-c", RESUME_ON_A_SMALL_DISK, "sh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = (tmp_path / "run.log").read_text()
    assert done.returncode == 2, f"{shlex.join(args)}\n{done.stderr}\n{log[-3000:]}"
    from titan_ckpt.layout import checkpoint_bytes
    from titan_ckpt.preflight import size_text

    # Each checkpoint counted at the size of the one there, which a failed save would quote.
    each = size_text(checkpoint_bytes(out / "step-2"))
    assert (
        f"[checkpoint] the checkpoints will not fit on the disk of {ckpt}: each holds about"
        f" {each} (the size of step-2, the newest there), this run saves 2 (keep_latest_k = 1"
        " keeps 1, plus the one being written, plus step-2, which this run resumes from and"
        " keeps)"
    ) in log, log[-3000:]
    assert "| loss" not in log and "Traceback" not in log
    assert sorted(p.name for p in out.iterdir()) == [".titan.lock", "step-2"]
