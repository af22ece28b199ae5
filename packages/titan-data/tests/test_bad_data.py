"""Data that cannot make batches fails when the loader is built, never by looping: empty
files, empty documents, a source smaller than one batch. Rows that are not text documents
are an error naming file and line before any batch (`bad_rows="error"`), or are skipped and
counted (`bad_rows="skip"`)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import write_jsonl

from titan_data import build_dataloader, load_source, load_tokenizer
from titan_data.errors import DataError
from titan_data.packing import SlotStream

BYTE = load_tokenizer("byte")
# A hang would otherwise be a test that never ends: each case must finish quickly.
pytestmark = pytest.mark.timeout(120)


def loader(path, *, seq_len=32, batch_size=2, **kw):
    return build_dataloader(
        dataset=str(path),
        dataset_path=None,
        tokenizer=BYTE,
        seq_len=seq_len,
        batch_size=batch_size,
        **kw,
    )


def test_an_empty_text_file_fails_at_start_up(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(
        DataError, match=r"gave packing stream 0 of 2 1 documents and no token in a whole pass"
    ):
        loader(tmp_path / "empty.txt")


def test_documents_that_are_all_empty_fail_at_start_up(tmp_path):
    path = write_jsonl(tmp_path / "blank.jsonl", [""] * 20)
    # Two samples per step: each stream reads 10 of the 20 documents.
    with pytest.raises(DataError, match=r"10 documents and no token .*every document is empty"):
        loader(path)


def test_a_source_too_small_for_one_batch_fails_at_start_up_with_the_numbers(tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", ["hi"])
    with pytest.raises(DataError) as info:
        loader(path, seq_len=128, batch_size=4)
    assert (
        "gives packing stream 0 of 4 4 tokens in a whole pass (1 documents), fewer than one"
        " sample needs: seq_len 128 + 1 = 129" in str(info.value)
    )


def test_an_epoch_without_tokens_is_an_error_even_past_the_start_up_checks(tmp_path):
    # A stream built directly, without build_dataloader's checks: it must not spin.
    path = write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    raw = SlotStream(load_source(path), BYTE, slot=0, slots=1, seq_len=8)
    with pytest.raises(DataError, match="no token in a whole pass"):
        raw.next_window()


def _good(n=40):
    return [f"document number {i} with some words in it" for i in range(n)]


BAD_LINES = {
    "missing_field": (json.dumps({"body": "x"}) + "\n").encode(),
    "malformed_json": b'{"text": "unterminated\n',
    "invalid_utf8": b'{"text": "caf\xe9"}\n',
    "non_string_field": (json.dumps({"text": 12345}) + "\n").encode(),
}
REASONS = {
    "missing_field": "has no field 'text'; fields found: 'body'",
    "malformed_json": "malformed JSON (Invalid control character at column 23)",
    "invalid_utf8": "invalid UTF-8 at byte 14 of the line",
    "non_string_field": "field 'text' holds int, not text",
}


def _with_bad_line(path, kind, at=7, compress=False):
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in _good()]
    lines.insert(at - 1, BAD_LINES[kind])
    data = b"".join(lines)
    if compress:
        path = path.with_suffix(".jsonl.gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_bad_row_after_the_first_ones_is_named_by_file_and_line_before_training(tmp_path, kind):
    path = _with_bad_line(tmp_path / "data.jsonl", kind, compress=kind == "invalid_utf8")
    with pytest.raises(DataError) as info:
        loader(path)
    message = str(info.value)
    assert f"{path}:7: {REASONS[kind]}" in message, message
    assert 'set bad_rows = "skip"' in message
    assert "Traceback" not in message and "pyarrow" not in message


def test_skipped_rows_are_counted_and_the_good_rows_give_the_same_batches(tmp_path):
    good = _good()
    lines = [(json.dumps({"text": d}) + "\n").encode() for d in good]
    for i, kind in enumerate(sorted(BAD_LINES)):
        lines.insert(5 + 9 * i, BAD_LINES[kind])
    (tmp_path / "mixed.jsonl").write_bytes(b"".join(lines))
    clean = write_jsonl(tmp_path / "clean.jsonl", good)

    # One sample per step, so one stream reads every row: skipping the bad ones leaves the
    # clean file's documents in the clean file's order.
    mixed = loader(tmp_path / "mixed.jsonl", bad_rows="skip", infinite=False, batch_size=1)
    expected = list(loader(clean, infinite=False, batch_size=1))
    got = list(mixed)
    assert len(got) == len(expected) > 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected))
    assert mixed.skipped_rows == 4
    # The count travels with the loader's state (into checkpoints).
    resumed = loader(tmp_path / "mixed.jsonl", bad_rows="skip", infinite=False, batch_size=1)
    resumed.load_state_dict(mixed.state_dict())
    assert resumed.skipped_rows == 4


def test_a_text_field_of_the_wrong_type_in_parquet_fails_at_start_up(tmp_path):
    pq.write_table(pa.table({"text": list(range(50))}), tmp_path / "numbers.parquet")
    with pytest.raises(
        DataError, match=r"numbers.parquet: row 1 of stream 0: field 'text' holds int"
    ):
        loader(tmp_path / "numbers.parquet")
    # Two streams of 25 rows each.
    with pytest.raises(DataError, match=r"25 bad rows skipped\): no row was a text document"):
        loader(tmp_path / "numbers.parquet", bad_rows="skip")


def _hub_copy(folder, broken_shard):
    """A local copy of a hub dataset: four json.gz shards of 400 rows; `broken_shard` cannot be
    parsed after its first 200 rows."""
    folder.mkdir()
    rows = "".join(json.dumps({"text": d}) + "\n" for d in _good(200))
    for shard in range(4):
        with gzip.open(folder / f"c4-train.{shard:05d}.json.gz", "wt") as f:
            f.write(rows + ('{"text": "broken\n' if shard == broken_shard else "") + rows)
    return dict(
        dataset="someone/corpus",
        dataset_path=str(folder),
        tokenizer=BYTE,
        seq_len=32,
        batch_size=2,
        infinite=False,
    )


def test_an_unreadable_row_of_a_streamed_dataset_is_named_not_a_raw_traceback(tmp_path):
    # Hub data (and local copies of it) go through `datasets` and pyarrow, which cannot skip a
    # broken line: it stops with a DataError naming the dataset, at start-up when the broken
    # shard is among the first ones read, while iterating when it comes later. With two
    # samples per step, stream 0 reads shards 0 and 2, stream 1 shards 1 and 3.
    with pytest.raises(DataError) as info:
        build_dataloader(**_hub_copy(tmp_path / "a", broken_shard=0))
    message = str(info.value)
    assert message.startswith("dataset someone/corpus (someone/corpus split train from local copy")
    assert "reading row 1 failed: ArrowInvalid: JSON parse error" in message

    source = build_dataloader(**_hub_copy(tmp_path / "b", broken_shard=3))
    with pytest.raises(DataError) as info:
        for _ in source:
            pass
    message = str(info.value)
    assert "reading row 401 of stream 1 of 2 failed: ArrowInvalid: JSON parse error" in message
    assert "Traceback" not in message
