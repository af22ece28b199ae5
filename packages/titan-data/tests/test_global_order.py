"""The global sample order does not depend on the layout: every data-parallel degree, local
batch size (gradient accumulation) and worker count gives the same global batches, and a state
saved on one layout resumes on any other, continuing with exactly the global batches the
uninterrupted run saw. Checked on a jsonl file and on a mixture of raw text, the embedded
corpus and a folder of tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_documents, write_jsonl

from titan_data import build_dataloader, load_tokenizer
from titan_data.pretokenize import tokenize_source

BYTE = load_tokenizer("byte")
G, SEQ = 8, 24  # samples per optimizer step, tokens per sample
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    jsonl = write_jsonl(root / "docs.jsonl", make_documents(120))
    tokens = str(root / "tokens")
    tokenize_source(
        dataset=write_jsonl(root / "other.jsonl", [d.upper() for d in make_documents(60)]),
        dataset_path=None,
        tokenizer="byte",
        out=tokens,
        shard_tokens=1500,
        progress=False,
    )
    return {"jsonl": jsonl, "mixture": f"{jsonl}:2,pydocs:1,{tokens}:1"}


def make(dataset, dp, local, workers=0, rank=0, **kw):
    return build_dataloader(
        dataset=dataset,
        dataset_path=None,
        tokenizer=BYTE,
        seq_len=SEQ,
        batch_size=local,
        global_batch_size=G,
        dp_rank=rank,
        dp_world_size=dp,
        num_workers=workers,
        **kw,
    )


def run(dataset, dp, local, workers, steps, state=None):
    """Global batches of `steps` steps on this layout ([G, SEQ] each: every rank's microbatches
    in rank order), and the merged state after them, through a JSON round trip as a checkpoint
    would store it."""
    accumulation = G // (local * dp)
    per_step = [[] for _ in range(steps)]
    loaders = [make(dataset, dp, local, workers, rank) for rank in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        batches = iter(loader)
        for step in range(steps):
            for _ in range(accumulation):
                inputs, labels = next(batches)
                assert torch.equal(inputs[:, 1:], labels[:, :-1])
                per_step[step].append(inputs)
    merged = loaders[0].merge_state_dicts([loader.state_dict() for loader in loaders])
    return [torch.cat(parts) for parts in per_step], json.loads(json.dumps(merged))


LAYOUTS = [  # (data-parallel degree, local batch size, workers)
    (1, 2, 0),  # 4 microbatches per step
    (2, 2, 0),
    (4, 2, 0),
    (8, 1, 0),
    (2, 4, 2),
    (4, 1, 1),
]


@pytest.mark.parametrize("name", ["jsonl", "mixture"])
def test_every_layout_and_worker_count_gives_the_same_global_batches(datasets, name):
    reference, _ = run(datasets[name], 1, G, 0, steps=5)
    assert len({tuple(b[:, 0].tolist()) for b in reference}) == 5  # the steps differ
    for dp, local, workers in LAYOUTS:
        got, _ = run(datasets[name], dp, local, workers, steps=5)
        assert all(torch.equal(a, b) for a, b in zip(got, reference)), (dp, local, workers)


@pytest.mark.parametrize(
    "before, after",
    [
        ((2, 2, 0), (4, 2, 0)),
        ((4, 2, 0), (1, 4, 0)),
        ((1, 8, 0), (2, 2, 2)),
        ((4, 1, 1), (8, 1, 0)),
    ],
)
def test_a_state_saved_on_one_layout_resumes_on_another_with_the_same_global_batches(
    datasets, before, after
):
    dataset = datasets["mixture"]
    reference, _ = run(dataset, 1, G, 0, steps=7)
    first, state = run(dataset, *before, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(first, reference[:3]))
    resumed, _ = run(dataset, *after, steps=4, state=state)
    for step, (a, b) in enumerate(zip(resumed, reference[3:]), 3):
        assert torch.equal(a, b), f"step {step} differs after resuming {before} -> {after}"


def test_a_state_from_inside_a_step_resumes_only_on_its_own_layout(datasets):
    dataset = datasets["jsonl"]
    reference = make(dataset, 1, 2)
    batches = iter(reference)
    next(batches)  # microbatch 1 of 4 of step 0
    state = reference.state_dict()
    assert state["micro"] == 1
    same = make(dataset, 1, 2)
    same.load_state_dict(state)
    assert torch.equal(next(iter(same))[0], next(batches)[0])
    with pytest.raises(ValueError, match="saved after microbatch 1 of a step"):
        make(dataset, 2, 2).load_state_dict(state)


def test_a_state_from_another_global_batch_size_is_refused_naming_it(datasets):
    saved = make(datasets["jsonl"], 1, 8)
    next(iter(saved))
    other = build_dataloader(
        dataset=datasets["jsonl"], dataset_path=None, tokenizer=BYTE, seq_len=SEQ, batch_size=4
    )
    with pytest.raises(ValueError) as info:
        other.load_state_dict(saved.state_dict())
    message = str(info.value)
    assert "global_batch_size 8 (this loader: 4)" in message
    assert "keep the global batch size when the data-parallel degree changes" in message


def test_ranks_that_took_different_numbers_of_batches_cannot_be_merged(datasets):
    ranks = [make(datasets["jsonl"], 2, 4, rank=r) for r in range(2)]
    next(iter(ranks[0]))
    with pytest.raises(ValueError, match="disagree between data-parallel ranks 0 and 1 on step"):
        ranks[0].merge_state_dicts([r.state_dict() for r in ranks])
