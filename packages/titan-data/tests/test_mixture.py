"""Weighted mixtures: the `dataset` string's forms, exact shares at every step, deterministic
and resumable draws, and the tokens taken from each source."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import write_jsonl

from titan_data import build_dataloader, load_tokenizer, parse_datasets
from titan_data.mixture import Entry
from titan_data.order import Mixture
from titan_data.spec import describe_dataset

BYTE = load_tokenizer("byte")


def test_the_dataset_string_takes_one_dataset_or_weighted_entries(tmp_path):
    assert parse_datasets("c4", "/data/c4") == [Entry("c4", "/data/c4", 1.0, "c4")]
    assert parse_datasets("c4:0.7,pydocs:0.3") == [
        Entry("c4", None, 0.7, "c4"),
        Entry("pydocs", None, 0.3, "pydocs"),
    ]
    (tmp_path / "code").mkdir()
    entries = parse_datasets(f"c4=/data/c4:3,{tmp_path}/code/*.jsonl,someone/corpus:1")
    assert [(e.dataset, e.dataset_path, e.weight, e.label) for e in entries] == [
        ("c4", "/data/c4", 3.0, "c4"),
        (f"{tmp_path}/code/*.jsonl", None, 1.0, "code"),  # the path's last plain component
        ("someone/corpus", None, 1.0, "someone/corpus"),
    ]
    assert [e.label for e in parse_datasets("pydocs:1,pydocs:2")] == ["pydocs#0", "pydocs#1"]


@pytest.mark.parametrize(
    "dataset, path, message",
    [
        ("c4:0.5,pydocs:0", None, "weight 0 is not valid; use a positive weight"),
        ("c4:-1,pydocs", None, "weight -1 is not valid"),
        ("c4,,pydocs", None, "has an empty entry"),
        ("c4:1,pydocs:1", "/data", "give each entry its own path as DATASET=PATH"),
    ],
)
def test_bad_mixtures_are_refused_naming_the_entry(dataset, path, message):
    with pytest.raises(ValueError, match=message):
        parse_datasets(dataset, path)


def test_counts_stay_within_one_sample_of_their_shares_at_every_step():
    mixture = Mixture([0.5, 0.3, 0.2])
    counts = [0, 0, 0]
    for step in range(1, 200):
        draws = mixture.assign(counts, 7)
        assert len(draws) == 7
        total = 7 * step
        for share, count in zip(mixture.weights, counts):
            assert abs(count - share * total) <= 1, (step, counts)
    # The index within a source counts that source's samples, in order.
    again = Mixture([0.5, 0.3, 0.2]).assign([0, 0, 0], 7 * 199)
    per_source = {j: [i for s, i in again if s == j] for j in range(3)}
    assert all(v == list(range(len(v))) for v in per_source.values())


def test_rows_come_from_each_source_by_weight_and_tokens_are_counted_per_source(tmp_path):
    # Documents of "a"s and of "b"s: each row's bytes tell its source.
    a = write_jsonl(tmp_path / "a.jsonl", ["a" * (40 + i) for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * (30 + i) for i in range(40)])
    loader = build_dataloader(
        dataset=f"{a}:3,{b}:1",
        dataset_path=None,
        tokenizer=BYTE,
        seq_len=16,
        batch_size=4,
        global_batch_size=8,
    )
    rows, batches = [], iter(loader)
    for _ in range(20):  # 10 steps of 2 microbatches
        inputs, _ = next(batches)
        rows += [r for r in inputs.tolist()]
    source = ["a" if ord("a") in r else "b" for r in rows]
    assert all(("a" in s) != ("b" in s) for s in [{chr(t) for t in r if t < 256} for r in rows])
    assert source.count("a") == 60 and source.count("b") == 20
    assert loader.tokens_by_source == {"a": 60 * 16, "b": 20 * 16}
    resumed = build_dataloader(
        dataset=f"{a}:3,{b}:1",
        dataset_path=None,
        tokenizer=BYTE,
        seq_len=16,
        batch_size=4,
        global_batch_size=8,
    )
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert resumed.tokens_by_source == loader.tokens_by_source
    assert torch.equal(next(iter(resumed))[0], next(batches)[0])


def test_a_mixture_is_described_entry_by_entry_with_its_shares(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", ["x"])
    described = describe_dataset(f"pydocs:3,{path}:1")
    assert described.startswith("75% pydocs: embedded Python documentation, train split; 25% ")
    assert "1 jsonl file" in described
