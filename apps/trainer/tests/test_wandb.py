"""`metrics.enable_wandb`: the same scalars as the console line and TensorBoard reach a W&B run,
checked in W&B's offline mode by reading the run file it writes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
from conftest import DEBUG_TOML, parse_losses, run_cli


def read_history(run_file) -> list[dict]:
    """The history rows of an offline W&B run file (its record log: 7-byte identifier, then
    32 KiB blocks of records, each with a 7-byte header as in LevelDB's log format)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    block, offset, records, partial = 32 * 1024, 7, [], b""
    while offset + 7 <= len(data):
        if block - offset % block < 7:
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


def test_wandb_run_holds_the_logged_scalars(tmp_path):
    result = run_cli(
        [
            "--job.config_file",
            str(DEBUG_TOML),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "3",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_wandb",
        ],
        env_extra={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "titan-test"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    rows = [r for r in read_history(runs[0]) if "loss" in r]
    logged = parse_losses(result.stdout)
    assert [r["_step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["loss"] == pytest.approx(logged[row["_step"]], abs=1e-4)
        assert {"grad_norm", "lr", "tokens_per_s", "mfu_pct", "mem_peak_gib"} <= set(row)


def test_without_wandb_installed_enabling_it_stops_before_the_run(tmp_path):
    # `sys.modules[name] = None` is Python's own way to make a package unimportable: the
    # process sees no wandb, as after `pip install titan-llm-trainer` without the extra.
    code = (
        "import sys; sys.modules['wandb'] = None\n"
        "from titan_trainer.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [
            sys.executable, "-c", code, "--job.config_file", str(DEBUG_TOML),
            "--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_wandb",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.endswith(  # after torch's own import-time warnings, if any
        "titan: config error: [metrics] enable_wandb = true, but wandb is not installed\n"
        "       pip install 'titan-llm-trainer[wandb]' (or in the workspace: uv sync --all-packages --inexact --extra wandb), or turn it off\n"
    )
    assert not (tmp_path / "run").exists()  # nothing started
