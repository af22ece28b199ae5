import json
import logging
import re

import pytest
import torch
from conftest import write_jsonl

from titan_core import DataSpec, StatefulLoader, Tokenizer, plugins, resolve
from titan_data import DataError, build_dataloader, load_tokenizer, pydocs_documents

BYTE = load_tokenizer("byte")


def loader(dataset, dataset_path=None, *, tokenizer=BYTE, seq_len=32, batch_size=2, **kw):
    return build_dataloader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=seq_len,
        batch_size=batch_size,
        **kw,
    )


def windows(batches):
    """The seq_len + 1 token windows the batches were cut from, in order."""
    rows = []
    for inputs, labels in batches:
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
        rows.extend(torch.cat([inputs, labels[:, -1:]], dim=1).tolist())
    return rows


def stream(documents, tokenizer=BYTE):
    return [t for d in documents for t in tokenizer.encode(d, bos=True, eos=True)]


def chunks(tokens, size):
    return [tokens[i : i + size] for i in range(0, len(tokens) - size + 1, size)]


def test_each_slot_packs_its_own_documents_into_windows_with_bos_and_eos(jsonl_file, documents):
    # Three samples per step: slot s packs documents s, s + 3, s + 6, ... into its own stream,
    # and row s of every batch is that stream's next window.
    batches = list(loader(jsonl_file, seq_len=37, batch_size=3, infinite=False))
    assert all(b[0].shape == (3, 37) for b in batches) and len(batches) > 5
    rows = [torch.cat([inputs, labels[:, -1:]], dim=1) for inputs, labels in batches]
    for slot in range(3):
        expected = chunks(stream(documents[slot::3]), 38)
        got = [r[slot].tolist() for r in rows]
        assert got == expected[: len(got)]
    flat = [t for r in rows for t in r[0].tolist()]
    assert flat[0] == BYTE.bos_id
    ends = [i for i, t in enumerate(flat) if t == BYTE.eos_id]
    assert len(ends) > 5 and all(flat[i + 1] == BYTE.bos_id for i in ends if i + 1 < len(flat))
    windows(batches)  # labels are the inputs shifted by one


class Messages(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_infinite_loader_repeats_the_data_and_logs_each_epoch(tmp_path, documents):
    path = write_jsonl(tmp_path / "five.jsonl", documents[:5])
    # The titan logger may not propagate (init_logging turns that off), so listen on it directly.
    titan_log, messages = logging.getLogger("titan"), Messages()
    titan_log.addHandler(messages)
    # setLevel, not the attribute: it clears the loggers' cached levels (an earlier INFO
    # message, a tokenizer's `tokenizer:` line, left "disabled" cached on titan.data).
    level = titan_log.level
    titan_log.setLevel(logging.INFO)
    try:
        # One sample per step: one stream reads every document.
        it = iter(loader(path, seq_len=15, batch_size=1))
        per_epoch = len(stream(documents[:5]))
        n = 3 * per_epoch // 16 + 1  # more than three epochs of tokens
        got = windows(next(it) for _ in range(n))
    finally:
        titan_log.removeHandler(messages)
        titan_log.setLevel(level)
    assert got == chunks(stream(documents[:5] * 4), 16)[:n]
    assert messages.lines[:3] == [
        f"data: {path} epoch {e} of packing stream 0 ended after 5 documents; starting epoch"
        f" {e + 1}"
        for e in range(3)
    ]


def resume_matches(make, ks, after=3):
    """For each k: take the state after k batches, resume a fresh loader from it (through a
    JSON round trip, as a checkpoint would store it) and compare the next `after` batches with
    the uninterrupted run, bit for bit."""
    reference = make()
    it = iter(reference)
    batches, states = [], {}
    for i in range(max(ks) + after):
        if i in ks:
            states[i] = json.loads(json.dumps(reference.state_dict()))
        batches.append(next(it))
    for k in ks:
        resumed = make()
        resumed.load_state_dict(states[k])
        rit = iter(resumed)
        for j in range(after):
            got = next(rit)
            assert torch.equal(got[0], batches[k + j][0]) and torch.equal(got[1], batches[k + j][1])
    return batches, reference


@pytest.mark.parametrize("world", [1, 2])
def test_resume_from_state_matches_uninterrupted_run_on_pydocs(world):
    for rank in range(world):
        resume_matches(
            lambda rank=rank: loader(
                "pydocs", seq_len=512, batch_size=4, dp_rank=rank, dp_world_size=world
            ),
            ks=[0, 1, 4, 9],
        )


@pytest.mark.parametrize("world", [1, 2])
def test_resume_across_epoch_boundaries_on_sharded_files(two_jsonl_files, world):
    # Small windows make several epochs pass within the run.
    for rank in range(world):
        _, reference = resume_matches(
            lambda rank=rank: loader(
                two_jsonl_files, seq_len=63, batch_size=4, dp_rank=rank, dp_world_size=world
            ),
            ks=[0, 2, 5, 11, 17, 23, 29, 31, 37, 43, 53, 60],
        )
        epochs = [s["epoch"] for s in reference.state_dict()["streams"].values()]
        assert max(epochs) >= 2  # the run crossed two epoch boundaries


def test_resume_with_the_llama3_tokenizer(llama3, c4_clone):
    batches, _ = resume_matches(
        lambda: loader(
            "c4", c4_clone, tokenizer=llama3, seq_len=16, batch_size=2, dp_rank=1, dp_world_size=2
        ),
        ks=[0, 3, 8],
    )
    ids = torch.cat([b[0] for b in batches])
    assert ids.max() < llama3.vocab_size and (ids == llama3.bos_id).any()


def test_a_resumed_loader_can_be_checkpointed_again(two_jsonl_files):
    def make():
        return loader(two_jsonl_files, seq_len=31, batch_size=2)

    reference = iter(make())
    expected = [next(reference) for _ in range(12)]
    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    second = make()
    second.load_state_dict(first.state_dict())
    state = second.state_dict()  # before iterating: the loaded position
    it2 = iter(second)
    for _ in range(4):
        next(it2)
    third = make()
    third.load_state_dict(second.state_dict())
    fourth = make()
    fourth.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(iter(third), expected[7:]))
    assert torch.equal(next(iter(fourth))[0], expected[3][0])


def decoded_doc_ids(batches):
    text = BYTE.decode([t for row in windows(batches) for t in row])
    return re.findall(r"doc-(\d{4})", text)


def test_ranks_read_disjoint_documents(jsonl_file, documents):
    # Two ranks, two samples each per step: rank r holds slots 2r and 2r + 1, which read
    # documents 2r, 2r + 4, ... and 2r + 1, 2r + 5, ...
    seen = []
    for rank in range(2):
        batches = list(
            loader(
                jsonl_file, seq_len=40, batch_size=2, dp_rank=rank, dp_world_size=2, infinite=False
            )
        )
        rows = [torch.cat([i, lab[:, -1:]], dim=1) for i, lab in batches]
        for position in range(2):
            got = [r[position].tolist() for r in rows]
            slot = 2 * rank + position
            assert got == chunks(stream(documents[slot::4]), 41)[: len(got)]
        seen.append(set(decoded_doc_ids(batches)))
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) >= 40  # all but the documents in each stream's dropped tail


def test_infinite_ranks_with_unequal_shares_produce_equal_batch_counts(tmp_path, documents):
    path = write_jsonl(tmp_path / "three.jsonl", [documents[0], documents[1] * 10, documents[2]])
    counts = []
    for rank in range(2):
        it = iter(loader(path, seq_len=16, batch_size=1, dp_rank=rank, dp_world_size=2))
        counts.append(sum(1 for _ in zip(range(200), it)))
    assert counts == [200, 200]


def test_a_stream_without_documents_gets_a_clear_error_when_the_loader_is_built(
    tmp_path, documents
):
    path = write_jsonl(tmp_path / "one.jsonl", documents[:1])
    assert next(iter(loader(path, seq_len=4, batch_size=1, dp_rank=0, dp_world_size=2)))[
        0
    ].shape == (1, 4)
    with pytest.raises(DataError) as info:
        loader(path, seq_len=4, batch_size=1, dp_rank=1, dp_world_size=2)
    message = str(info.value)
    assert "gives packing stream 1 of 2 no documents" in message
    assert "fewer documents (or shards) than the global batch has samples (2)" in message
    assert "titan-data tokenize" in message


def test_state_from_a_different_setup_is_refused(jsonl_file):
    source = loader(jsonl_file, seq_len=32)
    next(iter(source))
    with pytest.raises(ValueError, match=r"seq_len 32 \(this loader: 64\)"):
        loader(jsonl_file, seq_len=64).load_state_dict(source.state_dict())


def test_spec_is_found_through_the_entry_point_and_meets_the_protocols():
    spec = resolve(plugins.DATA, "titan")
    assert isinstance(spec, DataSpec) and spec.name == "titan"
    tokenizer = spec.build_tokenizer("byte")
    built = spec.build_dataloader(
        dataset="pydocs", dataset_path=None, tokenizer=tokenizer, seq_len=8, batch_size=2
    )
    assert isinstance(tokenizer, Tokenizer) and isinstance(built, StatefulLoader)
    inputs, labels = next(iter(built))
    first = pydocs_documents("train")[0].encode()
    assert inputs[0].tolist() == [BYTE.bos_id, *first[:7]]
