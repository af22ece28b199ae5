"""Worker processes: the same batches as in-process loading (test_global_order.py checks every
layout), and failures that end with a clear `DataError`, never a hang or a worker traceback."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import signal

import pytest

from titan_data import DataError, build_dataloader, load_tokenizer

BYTE = load_tokenizer("byte")
pytestmark = pytest.mark.timeout(120)  # a hang would otherwise be a test that never ends


def test_a_killed_worker_ends_iteration_with_a_data_error_not_a_hang():
    loader = build_dataloader(
        dataset="pydocs",
        dataset_path=None,
        tokenizer=BYTE,
        seq_len=64,
        batch_size=2,
        num_workers=2,
    )
    before = set(multiprocessing.active_children())
    batches = iter(loader)
    next(batches)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    with pytest.raises(DataError) as info:
        for _ in range(100_000):  # what the dead worker had made already comes first
            next(batches)
    message = str(info.value)
    assert message.startswith(
        f"a data loader worker of dp rank 0 stopped: DataLoader worker (pid(s) {workers[0].pid})"
    )
    assert "resume from the last checkpoint" in message
    loader.close()
    assert all(not p.is_alive() for p in workers)


def test_a_row_a_worker_cannot_read_is_a_data_error_naming_it(tmp_path):
    # A local copy of a hub dataset in four json.gz shards, read through `datasets` (pyarrow).
    # With two samples per step, stream 1 (worker 1) reads shards 1 and 3; shard 3 cannot be
    # parsed, which it finds after the 400 rows of shard 1, long after the start-up checks.
    line = json.dumps({"text": "a document with some words in it"}) + "\n"
    for shard in range(4):
        with gzip.open(tmp_path / f"c4-train.{shard:05d}.json.gz", "wt") as f:
            f.write(line * 200 + ('{"text": "broken\n' if shard == 3 else "") + line * 200)
    loader = build_dataloader(
        dataset="someone/corpus",
        dataset_path=str(tmp_path),
        tokenizer=BYTE,
        seq_len=32,
        batch_size=2,
        num_workers=2,
    )
    with pytest.raises(DataError) as info:
        for _ in loader:
            pass
    message = str(info.value)
    assert message.startswith("dataset someone/corpus (someone/corpus split train from local copy")
    assert "reading row 401 of stream 1 of 2 failed: ArrowInvalid: JSON parse error" in message
    assert "Traceback" not in message and "worker process" not in message
