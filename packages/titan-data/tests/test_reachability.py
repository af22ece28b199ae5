"""Before a job starts, a dataset is opened once (`check_dataset`): a hub dataset that cannot be
read from this machine stops it with one message naming the dataset, why (no network, not in
the cache, ...) and the fixes. The hub's address is pointed at a closed port on this machine,
so the tests fail fast and alike whether or not the hub can be reached from here."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_data import DataError
from titan_data.reachability import check_dataset

CHECK = "from titan_data.reachability import check_dataset; check_dataset({!r})"


def run_check(dataset: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", CHECK.format(dataset)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", **env},
    )


def test_a_hub_dataset_out_of_reach_is_named_with_the_cause_and_the_fixes():
    start = time.monotonic()
    # Online (this package's tests run offline by default, see conftest.py).
    done = run_check("c4", HF_HUB_OFFLINE="0", HF_DATASETS_OFFLINE="0")
    assert time.monotonic() - start < 60  # one request, no retries
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()
    error = next(i for i, line in enumerate(message) if line.startswith("titan_data.errors"))
    assert message[error].startswith(
        "titan_data.errors.DataError: dataset c4 (allenai/c4 (en) split train from Hugging Face"
        " hub, streaming) cannot be read: this machine cannot reach the Hugging Face hub at"
        " http://127.0.0.1:9 (HF_ENDPOINT)"
    )  # the hub this environment names, not huggingface.co
    fixes = "\n".join(message[error + 1 :])
    assert "titan-data tokenize --dataset c4" in fixes
    assert "dataset_path at a local copy of allenai/c4" in fixes
    assert "with the dataset in the Hugging Face cache, set HF_HUB_OFFLINE=1" in fixes


def test_offline_a_dataset_missing_from_the_cache_is_named(tmp_path):
    done = run_check("c4_validation", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    assert done.returncode != 0
    assert (
        "dataset c4_validation (allenai/c4 (en) split validation from Hugging Face hub,"
        " streaming) cannot be read: it is not in the Hugging Face cache (HF_HUB_OFFLINE=1)"
    ) in done.stderr
    # HF_HUB_OFFLINE=1 is set already: the fix is to fill the cache, not to set it.
    assert "set HF_HUB_OFFLINE=1" not in done.stderr
    assert (
        "or read it once where the hub can be reached, to put it in the Hugging Face cache"
        " (HF_HUB_OFFLINE=1 here reads only that cache)"
    ) in done.stderr


def test_local_data_is_opened_and_its_first_document_read(tmp_path, jsonl_file):
    check_dataset(jsonl_file)
    check_dataset("pydocs:3,pydocs_validation:1")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="is empty"):
        check_dataset(str(empty))


def test_c4_test_is_torchtitans_folder_relative_to_the_working_directory(
    tmp_path, monkeypatch, jsonl_file
):
    from titan_data import load_source

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        load_source("c4_test")
    assert str(e.value) == (
        "dataset c4_test (torchtitan's sample of C4, kept in its repository) is read from"
        f" tests/assets/c4_test in a torchtitan checkout, and {tmp_path} has no such folder\n"
        "run from a torchtitan checkout, set dataset_path to that folder, or train on pydocs"
        " (embedded) or c4 (the hub)"
    )
    (tmp_path / "tests/assets/c4_test").mkdir(parents=True)
    (tmp_path / "tests/assets/c4_test/data.json").write_bytes(Path(jsonl_file).read_bytes())
    source = load_source("c4_test")
    assert source.description == "1 jsonl file (tests/assets/c4_test)"
    assert load_source("c4_test", jsonl_file).files == (jsonl_file,)  # dataset_path wins


def test_a_misspelled_dataset_name_gets_a_did_you_mean():
    from titan_data import load_source

    for typed, meant in (
        ("pydoc", "pydocs"),
        ("c4_tset", "c4_test"),
        ("c4-validation", "c4_validation"),
    ):
        with pytest.raises(ValueError) as e:
            load_source(typed)
        lines = str(e.value).splitlines()
        assert lines[:2] == [f"unknown dataset {typed!r}", f"did you mean {meant}?"], lines
        assert lines[2].startswith("known names: pydocs, ")
