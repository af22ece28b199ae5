"""Runs through the command a user types that must end well: a preempted run saves a full
checkpoint and resumes, a second run in the same dump folder is refused, a diverging run never
applies or saves a NaN step, and bad data or folders stop the run at start-up in one message.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_ckpt import Checkpoint, checkpoint_problems, load_consolidated
from titan_ckpt.cli import main as titan_ckpt
from titan_ckpt.layout import read_commit
from titan_trainer.checkpointing import after_interrupt
from titan_trainer.cli import main as titan_train

FAST = [
    "--training.mixed_precision_param",
    "float32",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_tflops",
    "1",
]


def error_of(stderr: str) -> str:
    """The trainer's error message: from its `titan: error:` line on (library warnings printed
    at import may come first)."""
    start = stderr.find("titan: error: ")
    assert start >= 0, f"no titan: error line in:\n{stderr}"
    return stderr[start:]


class Background:
    """A trainer run in its own session, its output going to a file that the test reads."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.file = open(log, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titan_trainer", *args],
            stdout=self.file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log.read_text())
            if match:
                return match
            assert self.proc.poll() is None, f"run ended early:\n{self.log.read_text()}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout}s:\n{self.log.read_text()}")

    def stop(self, sig: int, timeout: float = 300) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        finally:
            self.file.close()


def _in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`titan-train ARGS` in this process, as a finished command (exit code, stdout, stderr):
    the module fixture cannot use capsys, and a new process would import torch again."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = titan_train(args)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A run with `last_save_model_only` and `last_save_in_hf` (torchtitan's 8B settings),
    preempted by SIGTERM after its second step; while it runs, a second run is started in the
    same dump folder; afterwards the first run is resumed for one more step."""
    tmp = tmp_path_factory.mktemp("preempted")
    dump = tmp / "run"
    args = [
        "--job.config_file",
        str(Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        *FAST,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
    ]
    first = Background([*args, "--training.steps", "500"], tmp / "first.log")
    try:
        first.wait_for(r"step    2 \|")
        # Paused (alive, its lock held) while the second run is refused: it would otherwise
        # train on, for nothing, while the second run starts.
        first.proc.send_signal(signal.SIGSTOP)
        second = _in_process([*args, "--training.steps", "500"])
    finally:
        first.proc.send_signal(signal.SIGCONT)
        code = first.stop(signal.SIGTERM)
    log = first.log.read_text()
    step = int(re.search(r"SIGTERM: saving a full checkpoint at step (\d+)", log).group(1))
    # Read before the resumed run prunes or replaces anything.
    record = read_commit(dump / "checkpoint" / f"step-{step}")
    resumed = _in_process([*args, "--training.steps", str(step + 1)])
    return {
        "dump": dump,
        "first": first,
        "first_code": code,
        "first_log": log,
        "second": second,
        "step": step,
        "record": record,
        "resumed": resumed,
    }


def test_a_second_run_in_a_dump_folder_in_use_is_refused_with_the_holder(preempted):
    second = preempted["second"]
    assert second.returncode == 1, second.stdout + second.stderr
    error = error_of(second.stderr)
    assert error.startswith(
        f"titan: error: another run is using the dump folder {preempted['dump']} (host "
    ), error
    assert f"pid {preempted['first'].proc.pid}" in error
    assert "give this run another --job.dump_folder" in error
    assert "Traceback" not in second.stderr and "| loss" not in second.stdout


def test_a_sigterm_save_is_full_and_resumable_whatever_the_last_save_settings(preempted):
    # 143 (128 + SIGTERM, as a shell reports it): stopped early, with the checkpoint saved.
    assert preempted["first_code"] == 143, preempted["first_log"]
    step, record = preempted["step"], preempted["record"]
    assert f"checkpoint step {step} saved to" in preempted["first_log"]
    folder = preempted["dump"] / "checkpoint" / f"step-{step}"
    assert record["model_only"] is False
    assert {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"} <= set(
        record["states"]
    )
    assert not (folder / "hf").exists()  # no export: the run is not over
    resumed = preempted["resumed"]
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed at step {step}" in resumed.stdout
    # The resumed run's real last step does what the settings ask: model only, plus HF.
    last = preempted["dump"] / "checkpoint" / f"step-{step + 1}"
    assert read_commit(last)["model_only"] is True and (last / "hf" / "config.json").is_file()


def test_the_hf_export_of_a_trainer_checkpoint_loads_in_transformers_without_overrides(
    preempted, tmp_path
):
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from titan_core.plugins import MODELS, resolve  # noqa: PLC0415

    folder = preempted["dump"] / "checkpoint" / f"step-{preempted['step']}"
    if not folder.exists():  # pruned by the resumed run? keep_latest_k is 10: it must be there
        raise AssertionError(f"{folder} is gone")
    assert checkpoint_problems(folder) == []
    assert titan_ckpt(["convert", "dcp-to-hf", str(folder), str(tmp_path / "hf")]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert hf.config.vocab_size == 320  # 259 byte tokens padded to a multiple of 64
    spec = resolve(MODELS, "llama3")
    import dataclasses  # noqa: PLC0415

    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=320, max_seq_len=128)
    with torch.device("meta"):
        ours = spec.build(args)
    ours.to_empty(device="cpu")
    ours.init_weights()
    ours.load_state_dict(load_consolidated(folder, progress=False), strict=False)
    tokens = torch.randint(320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(tokens) - hf.eval()(tokens).logits).abs().max().item()
    # fp32 on both sides; only the order of operations differs (attention kernel, rotary form).
    assert diff <= 1e-4


def _debug(tmp_path, *extra):
    return [
        "--job.config_file",
        str(Path(__file__).resolve().parents[1] / "configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        *FAST,
        *extra,
    ]


def test_sigterm_and_ctrl_c_stop_with_exit_status_143_and_130(tmp_path):
    """Two runs side by side (without checkpoints): SIGTERM stops one, which says it saves
    nothing, with 143; Ctrl-C (SIGINT) the other with 130 (128 + the signal, as a shell
    reports it); 0 stays for a finished run."""
    runs = {
        sig: Background(
            _debug(tmp_path / sig.name, "--training.steps", "500"), tmp_path / f"{sig.name}.log"
        )
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    for run in runs.values():
        run.wait_for(r"step    1 \|")
    codes = {sig: run.stop(sig) for sig, run in runs.items()}
    assert codes == {signal.SIGTERM: 143, signal.SIGINT: 130}
    log = runs[signal.SIGTERM].log.read_text()
    assert re.search(r"SIGTERM: stopping at step \d+ without a checkpoint", log), log
    assert "saving" not in log
    log = runs[signal.SIGINT].log.read_text()
    assert re.search(
        r"Ctrl-C: stopped at step \d+ without a checkpoint \(checkpoint.enable is false\): a"
        r" rerun starts again at step 0",
        log,
    ), log
    assert "Traceback" not in log and "checkpoint stays" not in log


def test_what_ctrl_c_leaves_to_resume_from_is_said_as_it_is():
    every_25 = Checkpoint(enable=True, interval=25)
    assert after_interrupt(every_25, step=7, start_step=0) == (
        "Ctrl-C: stopped at step 7, before the first checkpoint (due at step 25, [checkpoint]"
        " interval): there is none to resume from, and a rerun starts again at step 0"
    )
    assert after_interrupt(every_25, step=57, start_step=0) == (
        "Ctrl-C: stopped at step 57; a rerun resumes from the checkpoint of step 50"
    )
    assert after_interrupt(every_25, step=57, start_step=55) == (
        "Ctrl-C: stopped at step 57, before this run's first checkpoint (due at step 75): a"
        " rerun resumes from step 55, where this run started"
    )
    assert "without a checkpoint" in after_interrupt(Checkpoint(), step=3, start_step=0)


def _main(args, capsys) -> tuple[int, str, str]:
    """`titan-train ARGS` in this process (saves the seconds of importing torch again): exit
    code, stdout, stderr."""
    code = titan_train(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_diverging_run_stops_without_applying_or_saving_the_nan_step(tmp_path, capsys):
    # lr 1e4: the weights blow up within a few steps and the loss or gradient norm turns NaN.
    code, out, err = _main(
        _debug(
            tmp_path,
            "--training.steps",
            "30",
            "--optimizer.lr",
            "1e4",
            "--lr_scheduler.warmup_steps",
            "0",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "1",
        ),
        capsys,
    )
    assert code == 1, out + err
    match = re.search(r"titan: error: step (\d+): loss \S+ and grad_norm \S+: not finite", err)
    assert match, err
    bad_step = int(match.group(1))
    assert "was not applied" in err and "Lower [optimizer] lr" in err
    folder = tmp_path / "run" / "checkpoint"
    steps = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))
    assert steps and max(steps) < bad_step  # nothing saved at or after the step that went wrong
    # Every checkpoint passes the offline check, values included.
    assert titan_ckpt(["verify", "--values", str(folder)]) == 0


def test_data_that_cannot_train_stops_the_run_before_it_starts_with_one_exit_status(
    tmp_path, capsys
):
    # Whether the pre-start checks find it (an empty file) or the loader as it is built (no
    # token in a pass, a bad row): the run never started, so every one is a config error,
    # exit 2 (a bad row exited 1 and an empty .jsonl 2).
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.txt").write_text("")
    path = tmp_path / "data.jsonl"
    good = [f'{{"text": "document {i} with a few words"}}\n' for i in range(300)]
    path.write_text("".join(good[:6]) + '{"text": 17}\n' + "".join(good[6:]))
    for data, said in (
        (tmp_path / "empty.jsonl", "is empty"),
        (tmp_path / "empty.txt", "no token in a whole pass"),
        (path, f"{path}:7: field 'text' holds int, not text"),
    ):
        code, out, err = _main(_debug(tmp_path, "--training.dataset", str(data)), capsys)
        assert code == 2, out + err
        assert config_error_of(err).startswith("titan: config error: [training] dataset"), err
        assert said in err and "Traceback" not in err and "| loss" not in out
    assert 'set bad_rows = "skip"' in err


def config_error_of(stderr: str) -> str:
    start = stderr.find("titan: config error: ")
    assert start >= 0, f"no titan: config error line in:\n{stderr}"
    return stderr[start:]


def test_data_without_a_text_field_names_the_key_that_sets_it_and_the_key_works(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text(
        "".join(f'{{"id": {i}, "body": "document {i} of a few words"}}\n' for i in range(300))
    )
    code, out, err = _main(_debug(tmp_path, "--training.dataset", str(path)), capsys)
    assert code == 2, out + err
    assert config_error_of(err).endswith(
        "has no field 'text'; fields found: 'id', 'body'\n"
        "       set [training] dataset_text_field to the field that holds the text\n"
    ), err
    both = [
        "--training.dataset",
        str(path),
        "--training.dataset_text_field",
        "body",
        "--training.steps",
        "1",
        "--validation.enable",
        "--validation.dataset",
        str(path),
        "--validation.steps",
        "1",
    ]
    # Training reads `body` now; the validation set has its own key, still `text`.
    code, out, err = _main(_debug(tmp_path, *both), capsys)
    assert code == 1, out + err
    assert "| loss" in out
    assert error_of(err).startswith(f"titan: error: [validation] dataset '{path}':"), err
    assert "set [validation] dataset_text_field to the field that holds the text" in err
    code, out, err = _main(
        _debug(tmp_path, *both, "--validation.dataset_text_field", "body"), capsys
    )
    assert code == 0, out + err
    assert re.search(r"step +1 \| validation loss \d", out), out


@contextlib.contextmanager
def _read_only(path: Path):
    """chmod for a normal user; root ignores modes, so the immutable attribute for root."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        undo = ["chmod", "755", str(path)]
    else:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"running as root and chattr +i failed here ({done.stderr.strip()})")
        undo = ["chattr", "-i", str(path)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("which", ["dump", "checkpoint"])
def test_a_read_only_folder_is_reported_at_start_up(tmp_path, capsys, which):
    folder = tmp_path / "run" / ("checkpoint" if which == "checkpoint" else "")
    with _read_only(folder):
        code, out, err = _main(
            _debug(tmp_path, "--training.steps", "1", "--checkpoint.enable"), capsys
        )
    assert code == 1, out + err
    first = error_of(err).splitlines()[0]
    assert first.startswith(f"titan: error: the {which} folder {folder} is not writable: "), err
    assert first.endswith(("Permission denied", "Operation not permitted"))
    assert "| loss" not in out  # stopped before training
