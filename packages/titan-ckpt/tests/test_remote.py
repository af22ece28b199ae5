"""Checkpoints on an object store (any fsspec URL; S3 here), against a real S3-compatible
server on 127.0.0.1 (moto's server mode), reached through s3fs as a job reaches S3: the same
atomic commit (marker written last), checksums, async saves and keep_latest_k as a local
folder, a SIGKILL in the middle of a save, a flipped byte, and the start-up checks."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_toy import assert_same, build_run, full_model, full_optimizer, train
from s3_server import s3_server

from titan_ckpt import (
    Checkpoint,
    CheckpointManager,
    check_loadable,
    check_space,
    list_checkpoints,
    storage,
)
from titan_ckpt.cli import main as ckpt_cli
from titan_ckpt.errors import CheckpointLoadError
from titan_core.run_folder import RunFolderError

WORKER = Path(__file__).with_name("s3_crash_worker.py")
README = Path(__file__).parents[1] / "README.md"


@pytest.fixture(scope="module")
def s3():
    """The s3fs file system of a server started once for this module."""
    import s3fs  # noqa: PLC0415

    with s3_server("titan"):
        yield s3fs.S3FileSystem()


def _objects(s3, url: str) -> list[str]:
    s3.invalidate_cache()
    prefix = url.removeprefix("s3://") + "/"
    return sorted(p.removeprefix(prefix) for p in s3.find(prefix))


def _resume(url: str, **config) -> tuple[CheckpointManager, object, int | None]:
    run = build_run(seed=31)
    manager = CheckpointManager(Checkpoint(enable=True, interval=2, **config), run.states(), url)
    return manager, run, manager.load()


def test_save_prune_resume_and_cli_on_s3(s3, tmp_path, capsys):
    url = "s3://titan/sync"
    run = build_run()
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=2, keep_latest_k=2), run.states(), url
    )
    train(run, 6, manager, last_step=6)
    manager.close()
    # keep_latest_k = 2: step-2 deleted once step-6 was committed; the checksum side files
    # went into the markers; the write test left nothing behind.
    assert [s for s, _ in list_checkpoints(url)] == [4, 6]
    files = [".metadata", "__0_0.distcp", "titan_commit.json", "config.toml"]
    assert _objects(s3, url) == sorted(
        f"step-{s}/{f}" for s in (4, 6) for f in files if f != "config.toml"
    )
    manager, resumed, step = _resume(url)
    assert step == 6
    assert_same(full_model(run.model), full_model(resumed.model), "model after resume from S3")
    assert_same(
        full_optimizer(run.model, run.optimizer),
        full_optimizer(resumed.model, resumed.optimizer),
        "optimizer after resume from S3",
    )
    assert resumed.data.position == run.data.position and resumed.state.step == 6
    manager.close()
    # The dry run's offline check reads the checkpoint's index from the store.
    shapes = {k: tuple(v.shape) for k, v in run.model.state_dict().items()}
    problems, note = check_loadable(Checkpoint(enable=True, folder=url), "/unused", shapes)
    assert problems == [] and f"would resume from {url}/step-6 (step 6)" in note, note
    shapes["out.weight"] = (1, 1)
    problems, _ = check_loadable(Checkpoint(enable=True, folder=url), "/unused", shapes)
    assert len(problems) == 1 and "out.weight" in problems[0], problems
    # The CLI takes URLs: list, verify, convert.
    assert ckpt_cli(["list", url]) == 0
    assert ckpt_cli(["verify", url]) == 0
    out = capsys.readouterr().out
    assert f"{url}/step-6: OK" in out and "xxh3_128 checksums" in out, out
    assert ckpt_cli(["convert", "dcp-to-torch", f"{url}/step-6", str(tmp_path / "m.pt")]) == 0
    saved = torch.load(tmp_path / "m.pt", weights_only=True)
    assert_same(full_model(run.model), saved["model"], "dcp-to-torch from S3")


def test_async_saves_on_s3_commit_in_background_and_resume(s3):
    url = "s3://titan/async"
    run = build_run()
    config = Checkpoint(enable=True, interval=2, keep_latest_k=1, async_mode="async")
    manager = CheckpointManager(config, run.states(), url)
    train(run, 4, manager)
    # step 4 is written in the background; committed by the next save or close()
    manager.close()
    assert [s for s, _ in list_checkpoints(url)] == [4]
    assert all(not name.startswith("step-2/") for name in _objects(s3, url))
    manager, resumed, step = _resume(url)
    assert step == 4
    assert_same(full_model(run.model), full_model(resumed.model), "model after async save to S3")
    manager.close()


@pytest.fixture(scope="module")
def killed(s3) -> dict[str, tuple[int, str]]:
    """Both workers, started together (each pays its own torch import): {where: (exit status,
    output)}."""
    procs = {
        where: subprocess.Popen(
            [sys.executable, str(WORKER), f"s3://titan/kill-{where}", where],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).parent,
        )
        for where in ("data", "commit")
    }
    return {where: (p.wait(timeout=300), p.stdout.read()) for where, p in procs.items()}


@pytest.mark.parametrize("where", ["data", "commit"])
def test_sigkill_during_s3_save_keeps_previous_and_resume_matches_uninterrupted(s3, killed, where):
    url = f"s3://titan/kill-{where}"
    status, output = killed[where]
    assert status == -9 and "SAVED 2" in output and "KILLING" in output, output
    assert "step-2/titan_commit.json" in _objects(s3, url)
    assert [s for s, _ in list_checkpoints(url)] == [2]
    if where == "commit":  # everything but the marker is there: still not a checkpoint
        assert {"step-4/.metadata", "step-4/__0_0.distcp"} <= set(_objects(s3, url))
        assert "step-4/titan_commit.json" not in _objects(s3, url)
    expected = build_run()
    train(expected, 6)
    manager, run, step = _resume(url)
    assert step == 2
    train(run, 4, manager, last_step=6)
    manager.close()
    assert_same(full_model(expected.model), full_model(run.model), "after the kill and resume")
    assert [s for s, _ in list_checkpoints(url)] == [2, 4, 6]
    assert not [n for n in _objects(s3, url) if n.endswith(".sum.json")]


def test_flipped_byte_on_s3_is_refused_and_previous_step_loaded(s3, capsys):
    url = "s3://titan/corrupt"
    run = build_run()
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), run.states(), url)
    train(run, 2, manager)
    at_2 = full_model(run.model)
    train(run, 2, manager)
    manager.close()
    data = f"{url.removeprefix('s3://')}/step-4/__0_0.distcp"
    blob = bytearray(s3.cat_file(data))
    blob[len(blob) // 2] ^= 0x01
    s3.pipe_file(data, bytes(blob))
    manager, resumed, step = _resume(url)
    assert step == 2
    assert_same(at_2, full_model(resumed.model), "model after falling back to step 2")
    manager.close()
    assert ckpt_cli(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"{url}/step-4: FAILED: __0_0.distcp does not match its xxh3_128 checksum" in out, out
    assert f"{url}/step-2: OK" in out, out
    # asked for by step, the corrupt one is named with the one that would do
    run = build_run()
    manager = CheckpointManager(Checkpoint(enable=True, load_step=4), run.states(), url)
    with pytest.raises(CheckpointLoadError, match="load_step = 2"):
        manager.load(4)
    manager.close()


def test_unwritable_url_is_refused_when_the_manager_starts(s3):
    run = build_run()
    with pytest.raises(RunFolderError, match="s3://no-such-bucket/run cannot be written"):
        CheckpointManager(Checkpoint(enable=True), run.states(), "s3://no-such-bucket/run")


def test_url_folder_and_space_check(s3):
    config = Checkpoint(enable=True, folder="s3://titan/space", interval=10, keep_latest_k=2)
    problems, note = check_space(config, "/outputs", 10 * 2**30, 100)
    assert problems == []
    assert "s3://titan/space needs up to 30.0 GiB more" in note, note
    assert "free space not checked (remote storage)" in note, note
    assert storage.join("/outputs", "checkpoint") == "/outputs/checkpoint"
    assert storage.join("s3://titan/out", "checkpoint") == "s3://titan/out/checkpoint"
    assert storage.join("/outputs", "s3://titan/ck") == "s3://titan/ck"


def test_a_store_that_cannot_be_reached_is_one_message_with_its_reason_and_fixes(s3, monkeypatch):
    from titan_ckpt.preflight import storage_problems  # noqa: PLC0415

    config = Checkpoint(enable=True, folder="s3://titan/unreached")
    assert storage_problems(config, "/outputs") == []  # the server answers: nothing to say
    # No server on that port (port 9, discard, is closed here); the probe gives up fast.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    (problem,) = storage_problems(config, "/outputs")
    lines = problem.splitlines()
    assert lines[0].startswith(
        "the [checkpoint] folder s3://titan/unreached cannot be reached: Could not connect to"
        ' the endpoint URL: "http://127.0.0.1:9/titan?'
    ), problem
    assert lines[1] == (
        "check the endpoint (AWS_ENDPOINT_URL = http://127.0.0.1:9), the credentials"
        " (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the network to it;"
        " or use a local folder"
    )
    assert len(lines) == 2


def test_storage_not_installed_names_what_to_install(monkeypatch):
    import importlib  # noqa: PLC0415

    # fsspec keeps the classes it imported; forget s3's, and make `import s3fs` fail.
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.delitem(registry._registry, "s3", raising=False)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(
        storage.StorageUnavailableError, match=r"pip install 'titan-llm-ckpt\[s3\]'"
    ):
        storage.as_path("s3://titan/run")
    assert ckpt_cli(["verify", "s3://titan/run"]) == 2
    # The trainer's config check says it before anything starts.
    problems = Checkpoint(enable=True, folder="s3://titan/run").validate()
    assert len(problems) == 1, problems
    assert problems[0].startswith("[checkpoint] folder = 's3://titan/run': s3://titan/run is on")
    assert problems[0].endswith("\npip install 'titan-llm-ckpt[s3]'"), problems


def test_readme_remote_commands_run_as_shown(s3, tmp_path, monkeypatch, capsys):
    """The README's `titan-ckpt` commands on a URL, on a checkpoint at the step they name."""
    section = README.read_text().split("## Remote storage", 1)[1]
    block = re.findall(r"```\n(titan-ckpt .*?)```", section, re.S)[0]
    commands = [shlex.split(line) for line in block.splitlines()]
    assert [c[1] for c in commands] == ["list", "verify", "convert"]
    s3.mkdir("bucket")
    run = build_run()
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1000), run.states(), "s3://bucket/run/checkpoint"
    )
    manager.save(1000)
    manager.close()
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert ckpt_cli(command[1:]) == 0, command
    assert "s3://bucket/run/checkpoint/step-1000: OK" in capsys.readouterr().out
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_same(full_model(run.model), saved["model"], "the README's dcp-to-torch from S3")
    # Without credentials: one line that says what to check, no traceback.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    import s3fs  # noqa: PLC0415

    s3fs.S3FileSystem.clear_instance_cache()
    try:
        assert ckpt_cli(["list", "s3://bucket/run/checkpoint"]) == 2
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err
    assert err.startswith("titan-ckpt: error: the storage refused: NoCredentialsError"), err


def test_hf_snapshots_on_s3_commit_by_their_marker_and_are_pruned(s3, tmp_path):
    from ckpt_toy_hf import SlicedToyAdapter, ToyAdapter, ToyArgs  # noqa: PLC0415

    from titan_ckpt import import_hf  # noqa: PLC0415
    from titan_ckpt.hf_snapshots import list_snapshots  # noqa: PLC0415

    url = "s3://titan/snapshots"
    run = build_run(dropout=0.0)
    config = Checkpoint(
        enable=True, interval=100, hf_interval=2, hf_keep_latest_k=1, hf_save_optimizer=True
    )
    manager = CheckpointManager(
        config,
        run.states(),
        url,
        hf_adapter=SlicedToyAdapter(ToyArgs()),
        hf_extra_files=lambda folder: (folder / "tokenizer.json").write_text("{}"),
    )
    train(run, 4, manager, last_step=4)
    manager.close()
    assert [s for s, _ in list_snapshots(url)] == [4]
    names = [n for n in _objects(s3, url) if n.startswith("hf/")]
    assert {"hf/step-4/titan_snapshot.json", "hf/step-4/tokenizer.json"} <= set(names), names
    assert "hf/step-4/titan_state/titan_commit.json" in names
    assert not any(n.startswith("hf/step-2/") for n in names), names
    s3.get(url.removeprefix("s3://") + "/hf/step-4", str(tmp_path / "hf"), recursive=True)
    back = import_hf(tmp_path / "hf", ToyAdapter(ToyArgs()), progress=False)
    assert_same(full_model(run.model), back, "snapshot on S3")
