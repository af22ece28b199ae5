"""Damaged Hugging Face weights are named, file and reason, from their headers, before
anything reads them: a garbled header, a truncated file, a header length of 2^62, a header
that names a tensor past the file's end, a broken index (issue 42, item 5)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from titan_ckpt import read_safetensors
from titan_ckpt.cli import main as titan_ckpt
from titan_ckpt.hf_check import HFFilesError, safetensors_problems
from titan_ckpt.hf_files import SafetensorsFolder


def _split(data: bytes) -> tuple[int, dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return length, json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(header: dict, tensors: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + tensors


def _garbled(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[10:20] = b"\xff" * 10
    return bytes(damaged)


def _past_the_end(data: bytes) -> bytes:
    _, header, tensors = _split(data)
    header["b"]["data_offsets"] = [64, 64 + 4 * 1000]
    header["b"]["shape"] = [1000]
    return _join(header, tensors)


# Each damage, and what is said of it given the damaged file's size. The intact file holds
# 96 bytes of tensor data (a 4 x 4 and an 8 of float32) after its header.
DAMAGE = {
    "garbled_header": (_garbled, lambda size: "its header is not a valid safetensors header"),
    "truncated": (
        lambda data: data[:-20],
        lambda size: "its header describes 96 bytes of tensor data, the file holds 76 (truncated",
    ),
    "header_length_2_to_the_62": (
        lambda data: struct.pack("<Q", 2**62) + data[8:],
        lambda size: (
            f"its header claims 4,611,686,018,427,387,904 bytes, but the file holds"
            f" {size - 8:,} after the length field"
        ),
    ),
    "tensor_past_the_end": (
        _past_the_end,
        lambda size: (
            "its header describes 4,064 bytes of tensor data, the file holds 96"
            " (truncated, or a header that names a tensor past the end)"
        ),
    ),
    "empty_file": (lambda data: b"", lambda size: "it has 0 bytes, fewer than a safetensors"),
}


@pytest.fixture
def hf_folder(tmp_path) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(8)}, str(folder / "model.safetensors"))
    return folder


def test_an_intact_folder_has_no_problem(hf_folder):
    assert safetensors_problems(hf_folder) == []
    assert sorted(SafetensorsFolder(hf_folder).tensors) == ["a", "b"]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_damaged_file_is_named_with_its_reason_by_every_reader(hf_folder, kind, capsys):
    damage, reason = DAMAGE[kind]
    path = hf_folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    (problem,) = safetensors_problems(hf_folder)
    assert problem.startswith(f"{path}: {reason(path.stat().st_size)}"), problem
    assert "the file is damaged or not a safetensors file" in problem
    for read in (SafetensorsFolder, read_safetensors):
        with pytest.raises(HFFilesError, match="the Hugging Face weights cannot be read"):
            read(hf_folder)
    # The command: one message, exit 2, before any model or process group.
    code = titan_ckpt(
        ["convert", "hf-to-dcp", str(hf_folder), str(hf_folder.parent / "out"),
         "--model", "llama3", "--flavor", "debugmodel"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("titan-ckpt: error: the Hugging Face weights cannot be read:\n"), err
    assert str(path) in err and "download the damaged files again" in err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert not (hf_folder.parent / "out").exists()


def test_a_broken_index_and_a_missing_shard_are_named(hf_folder):
    (hf_folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    (problem,) = safetensors_problems(hf_folder)
    assert problem.startswith(f"{hf_folder / 'model.safetensors.index.json'} cannot be read:")
    (hf_folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-2.safetensors"}})
    )
    assert safetensors_problems(hf_folder) == [
        f"{hf_folder / 'model-2.safetensors'} is named by model.safetensors.index.json but does"
        " not exist"
    ]
