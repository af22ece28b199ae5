"""`titan-data tokenize` and training from its folders: the shards hold the packed token stream,
an interrupted run resumes to the same bytes, training visits every window once per epoch in a
seeded order, and a folder that does not fit (unfinished, truncated, corrupt, another
tokenizer) is a clear error before or while training, naming the file."""

from __future__ import annotations

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_documents, write_jsonl

from titan_data import DataError, TokenShards, build_dataloader, load_tokenizer
from titan_data.cli import main
from titan_data.pretokenize import tokenize_source
from titan_data.token_shards import MANIFEST, shuffled

BYTE = load_tokenizer("byte")
TITAN_DATA = str(Path(sys.executable).parent / "titan-data")  # the console script
pytestmark = pytest.mark.timeout(300)


def tokens_of(folder: str) -> np.ndarray:
    shards = TokenShards(folder)
    return shards.read(0, shards.tokens)


def same_files(a: Path, b: Path) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and not filecmp.cmpfiles(a, b, names, shallow=False)[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretok")
    return write_jsonl(root / "docs.jsonl", make_documents(300))


def test_shards_hold_every_document_as_bos_text_eos_in_order(tmp_path, corpus):
    documents = make_documents(300)
    manifest = tokenize_source(
        dataset=corpus,
        dataset_path=None,
        tokenizer="byte",
        out=str(tmp_path / "t"),
        shard_tokens=2000,
        workers=2,
        progress=False,
    )
    expected = [t for d in documents for t in BYTE.encode(d, bos=True, eos=True)]
    assert tokens_of(str(tmp_path / "t")).tolist() == expected
    assert manifest["complete"] and manifest["documents"] == 300
    assert manifest["dtype"] == "<u2"  # 259 ids fit in two bytes
    # Each shard closes at the first document boundary past 2,000 tokens.
    for i, shard in enumerate(manifest["shards"]):
        offsets = np.load(tmp_path / "t" / shard["file"].replace(".bin", ".docs.npy"))
        assert offsets[0] == 0 and offsets[-1] == shard["tokens"]
        assert len(offsets) == shard["documents"] + 1
        if i < len(manifest["shards"]) - 1:
            assert offsets[-2] < 2000 <= offsets[-1]


def test_the_command_resumes_after_sigkill_to_the_same_bytes(tmp_path):
    args = ["tokenize", "--dataset", "pydocs", "--tokenizer", "byte", "--shard-tokens", "20000"]
    args += ["--workers", "1", "--quiet"]
    whole = subprocess.run([TITAN_DATA, *args, "--out", str(tmp_path / "whole")], timeout=240)
    assert whole.returncode == 0
    killed = subprocess.Popen([TITAN_DATA, *args, "--out", str(tmp_path / "cut")])
    third = tmp_path / "cut" / "shard-00002.bin"
    deadline = time.monotonic() + 200
    while not third.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL  # killed mid-way, not finished
    index = json.loads((tmp_path / "cut" / MANIFEST).read_text())
    assert not index["complete"] and index["shards"]
    again = subprocess.run(
        [TITAN_DATA, *args, "--out", str(tmp_path / "cut")], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert "titan-data: wrote " in again.stdout and " shards, 235 documents," in again.stdout
    assert same_files(tmp_path / "whole", tmp_path / "cut")
    shards = TokenShards(str(tmp_path / "cut"))
    assert shards.documents == 235 and len(shards.shards) > 3


def test_a_run_stopped_after_some_shards_goes_on_to_the_same_bytes(tmp_path, corpus):
    common = dict(dataset=corpus, dataset_path=None, tokenizer="byte", shard_tokens=1500)
    tokenize_source(**common, out=str(tmp_path / "whole"), progress=False)
    first = tokenize_source(**common, out=str(tmp_path / "parts"), max_shards=3, progress=False)
    assert not first["complete"] and len(first["shards"]) == 3
    (tmp_path / "parts" / "shard-00003.bin.tmp").write_bytes(b"half a shard")  # a crash's leftover
    tokenize_source(**common, out=str(tmp_path / "parts"), max_shards=2, progress=False)
    tokenize_source(**common, out=str(tmp_path / "parts"), progress=False)
    assert same_files(tmp_path / "whole", tmp_path / "parts")


def test_training_visits_every_window_once_per_epoch_in_a_seeded_order(tmp_path, corpus):
    folder = str(tmp_path / "t")
    tokenize_source(
        dataset=corpus, dataset_path=None, tokenizer="byte", out=folder, shard_tokens=997,
        progress=False,
    )  # fmt: skip
    stream = tokens_of(folder)
    seq = 31
    count = len(stream) // (seq + 1)
    expected = Counter(tuple(stream[i * 32 : i * 32 + 32].tolist()) for i in range(count))

    def epoch_windows(seed):
        loader = build_dataloader(
            dataset=folder, dataset_path=None, tokenizer=BYTE, seq_len=seq, batch_size=4,
            infinite=False, seed=seed,
        )  # fmt: skip
        return [
            tuple(torch.cat([i, lab[:, -1:]], 1)[r].tolist()) for i, lab in loader for r in range(4)
        ]

    first, again, other = epoch_windows(0), epoch_windows(0), epoch_windows(1)
    assert len(first) == count - count % 4  # the last partial step is dropped
    assert not Counter(first) - expected  # each window of the stream at most once
    assert first == again and first != other
    in_order = [tuple(stream[i * 32 : i * 32 + 32].tolist()) for i in range(len(first))]
    assert first != in_order  # shuffled, not read front to back


def test_the_window_order_is_a_permutation_for_any_size():
    for count in [1, 2, 3, 7, 64, 100, 1000, 4097]:
        for seed, epoch in [(0, 0), (5, 3)]:
            order = [shuffled(i, count, seed, epoch) for i in range(count)]
            assert sorted(order) == list(range(count)), (count, seed, epoch)
    assert [shuffled(i, 1000, 0, 0) for i in range(10)] != [
        shuffled(i, 1000, 0, 1) for i in range(10)
    ]


@pytest.fixture
def tokens(tmp_path, corpus):
    folder = tmp_path / "t"
    tokenize_source(
        dataset=corpus, dataset_path=None, tokenizer="byte", out=str(folder), shard_tokens=2000,
        progress=False,
    )  # fmt: skip
    return folder


def build(folder, tokenizer=BYTE):
    return build_dataloader(
        dataset=str(folder), dataset_path=None, tokenizer=tokenizer, seq_len=64, batch_size=2
    )


def test_an_unfinished_folder_is_refused_with_the_command_to_finish_it(tokens):
    index = json.loads((tokens / MANIFEST).read_text())
    index["complete"] = False
    (tokens / MANIFEST).write_text(json.dumps(index))
    with pytest.raises(DataError, match="tokenization did not finish .* run the same `titan-data"):
        build(tokens)


def test_a_truncated_shard_is_named_before_training(tokens):
    shard = tokens / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError) as info:
        build(tokens)
    tokens_recorded = json.loads((tokens / MANIFEST).read_text())["shards"][1]["tokens"]
    assert (
        f"{shard} holds {2 * tokens_recorded - 10:,} bytes, the index says {tokens_recorded:,}"
        f" tokens ({2 * tokens_recorded:,} bytes): the shard is truncated" in str(info.value)
    )


def test_tokens_of_another_tokenizer_are_refused_naming_both(tokens, llama3):
    with pytest.raises(DataError) as info:
        build(tokens, llama3)
    message = str(info.value)
    assert "was tokenized with byte" in message and "vocab_size 259 (this run: 128256)" in message


def test_a_corrupt_token_id_is_named_by_shard_and_position(tokens):
    shard = tokens / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[200:202] = (60000).to_bytes(2, "little")  # token 100 of the first shard
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{shard} token 100: token id 60000 is not below"):
        for _ in zip(range(1000), build(tokens)):
            pass


def test_a_malformed_index_is_named(tokens):
    (tokens / MANIFEST).write_text('{"format": "titan-tokens",')
    with pytest.raises(DataError, match=rf"{tokens / MANIFEST}: not a valid index"):
        build(tokens)


def test_a_bad_row_stops_tokenizing_naming_file_and_line_or_is_counted(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "one"}\n{"text": 5}\n{"text": "three"}\n')
    out = str(tmp_path / "t")
    assert main(["tokenize", "--dataset", str(path), "--tokenizer", "byte", "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"titan-data: error: dataset {path}: {path}:2: field 'text' holds int, not text" in err
    assert "Traceback" not in err
    args = ["tokenize", "--dataset", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "s")]
    assert main([*args, "--bad-rows", "skip", "--quiet"]) == 0
    assert "2 documents, 12 tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "s" / MANIFEST).read_text())["skipped_rows"] == 1


def test_rows_without_the_text_field_name_the_flag_that_sets_it(tmp_path, capsys):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f'{{"body": "document {i}"}}\n' for i in range(20)))
    args = ["tokenize", "--dataset", str(path), "--tokenizer", "byte", "--quiet"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "has no field 'text'; fields found: 'body'" in err
    assert err.endswith("set --text-field to the field that holds the text\n"), err
    assert main([*args, "--out", str(tmp_path / "b"), "--text-field", "body"]) == 0


def test_a_folder_made_with_other_settings_is_not_overwritten(tokens, corpus, capsys):
    args = ["tokenize", "--dataset", corpus, "--tokenizer", "byte", "--out", str(tokens)]
    assert main([*args, "--shard-tokens", "5000", "--quiet"]) == 2
    assert (
        "holds tokens made with other settings: shard_tokens 2000 (now 5000)"
        in capsys.readouterr().err
    )


def test_a_folder_of_tokens_is_named_as_the_dataset_itself(tokens):
    from titan_data import load_source

    assert isinstance(load_source(str(tokens)), TokenShards)
    with pytest.raises(
        ValueError, match="is a folder of tokens, so dataset_path .* would be ignored"
    ):
        load_source(str(tokens), "/data/elsewhere")
    with pytest.raises(
        ValueError, match="dataset_path .* is a folder of tokens; name it as the dataset"
    ):
        load_source("c4", str(tokens))


def test_the_progress_bar_ends_with_the_shard_count_of_the_last_line(tmp_path, corpus, capfd):
    manifest = tokenize_source(
        dataset=corpus,
        dataset_path=None,
        tokenizer="byte",
        out=str(tmp_path / "t"),
        shard_tokens=2000,
        workers=1,
        progress=True,
    )
    shards = len(manifest["shards"])
    assert shards > 2
    bar = capfd.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.endswith(f"{manifest['tokens']:,} tokens, {shards} shards]"), bar


def test_help_gives_the_whole_first_paragraph_of_the_description(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "`titan-data info` describes such a folder." in text
