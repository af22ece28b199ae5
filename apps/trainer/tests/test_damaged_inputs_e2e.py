"""Damaged or unreachable inputs end in one message that names the input, the reason and the
fix, never a library's traceback (issue 42, items 5 to 7): Hugging Face weights whose files
are damaged, a checkpoint folder on an S3 store that cannot be reached, and `titan-generate`
on a run whose checkpoints are damaged."""

from __future__ import annotations

import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

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


def test_damaged_hugging_face_weights_stop_the_run_before_it_starts(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.norm.weight": torch.ones(256)}, str(hf / "model-1.safetensors"))
    save_file({"lm_head.weight": torch.ones(8, 256)}, str(hf / "model-2.safetensors"))
    first = (hf / "model-1.safetensors").read_bytes()
    (hf / "model-1.safetensors").write_bytes(struct.pack("<Q", 2**62) + first[8:])
    second = (hf / "model-2.safetensors").read_bytes()
    (hf / "model-2.safetensors").write_bytes(second[: len(second) // 2])
    code = titan_train(
        _args(
            tmp_path / "run",
            *("--training.steps", "2", "--checkpoint.initial_load_in_hf"),
            *("--checkpoint.initial_load_path", str(hf)),
        )
    )
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    lines = out.err[out.err.index("titan: config error: ") :].splitlines()
    assert lines[0] == (
        f"titan: config error: [checkpoint] initial_load_path = {str(hf)!r} holds Hugging Face"
        " weights that cannot be read:"
    ), lines
    assert lines[1].strip().startswith(f"{hf / 'model-1.safetensors'}: its header claims ")
    assert lines[2].strip().startswith(f"{hf / 'model-2.safetensors'}: its header describes ")
    assert "download the damaged files again" in lines[3]
    assert "Traceback" not in out.err and "SafetensorError" not in out.err
    assert "| loss" not in out.out and not (tmp_path / "run" / "checkpoint").exists()


def test_an_unreachable_s3_store_is_one_message_before_anything_touches_it(
    tmp_path, capsys, monkeypatch
):
    # No server at the endpoint (port 9 is closed here); credentials as a user has them.
    for key, value in {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_ACCESS_KEY_ID": "titan-test",
        "AWS_SECRET_ACCESS_KEY": "titan-test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    url = "s3://titan/run/checkpoint"
    code = titan_train(
        _args(tmp_path / "run", "--training.steps", "2", "--checkpoint.enable",
              "--checkpoint.folder", url)
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    error = out.err[out.err.index("titan: config error: ") :].rstrip().splitlines()
    assert error[0].startswith(
        f"titan: config error: the [checkpoint] folder {url} cannot be reached: Could not"
        ' connect to the endpoint URL: "http://127.0.0.1:9/'
    ), error
    assert "check the endpoint (AWS_ENDPOINT_URL = http://127.0.0.1:9)" in error[1]
    assert len(error) == 2 and "Traceback" not in out.err and "botocore" not in out.err


def test_generate_passes_over_damaged_checkpoints_and_names_them_when_none_is_left(
    tmp_path, capsys
):
    from titan_trainer.generate import main as titan_generate

    dump = tmp_path / "run"
    args = _args(dump, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2")
    assert titan_train(args) == 0
    capsys.readouterr()
    folder = dump / "checkpoint"
    for step in (4, 2):  # newest first: the data file cut short, as a copy that stopped
        data = folder / f"step-{step}" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:1000])
        if step == 4:  # step 2 is still whole: used, and the damaged step 4 said
            assert titan_generate([str(dump), "--prompt", "The", "--max-new-tokens", "4"]) == 0
            out = capsys.readouterr()
            assert out.out.startswith("The"), out
            assert out.err.startswith(
                "titan-generate: step-4 is damaged (__0_0.distcp has 1,000 bytes"
            )
            assert out.err.rstrip().endswith("; using step-2"), out.err
    assert titan_generate([str(dump), "--prompt", "The", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"titan-generate: error: every checkpoint in {folder} is damaged:\n")
    assert "step-4: __0_0.distcp has 1,000 bytes" in err and "step-2: __0_0.distcp has" in err
    assert f"`titan-ckpt verify {folder}` checks them again" in err
    assert "Traceback" not in err and "EOFError" not in err
    assert titan_generate([str(folder / "step-2"), "--prompt", "The"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"titan-generate: error: {folder / 'step-2'} is damaged: "), err
