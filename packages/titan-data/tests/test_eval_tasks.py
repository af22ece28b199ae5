"""Evaluation tasks from local files (`titan_data.eval_tasks`): specs, the items' checks, the
requests lm-eval would make, the scores, the `task-file` command; and the tokenizer files a
Hugging Face export carries (`titan_data.hf_tokenizer_files`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from titan_data import ByteTokenizer
from titan_data.eval_tasks import (
    Task,
    TaskError,
    build_task,
    encode_pair,
    load_task_spec,
    rolling_windows,
    score,
)


def write_task(folder, rows, **spec) -> str:
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"name": "t", "kind": "multiple_choice", "data": "items.jsonl", **spec}
    lines = [f"{k} = {json.dumps(v)}" for k, v in spec.items()]
    path = folder / "t.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


MC = [
    {"q": "one plus one is", "c": ["two", "three", "four"], "a": 0},
    {"q": "the sky is", "c": ["green", "blue", "red"], "a": "1"},
    {"q": "water is", "c": ["dry", "hot", "wet"], "a": 2},
]


def test_a_multiple_choice_task_makes_one_request_per_choice(tmp_path):
    spec = load_task_spec(write_task(tmp_path, MC, context="Q: {q}\nA:", choices="c", target="a"))
    task = build_task(spec, ByteTokenizer(), max_len=256, add_bos=False)
    assert len(task.requests) == 9 and [i.gold for i in task.items] == [0, 1, 2]
    first = task.requests[0]
    assert bytes(first.context).decode() == "Q: one plus one is\nA:"
    assert bytes(first.continuation).decode() == " two"
    with_bos = build_task(spec, ByteTokenizer(), max_len=256, add_bos=True)
    assert with_bos.requests[0].context[0] == ByteTokenizer.bos_id


def test_few_shot_examples_come_before_the_item_and_never_are_it(tmp_path):
    path = write_task(tmp_path, MC, context="{q}", choices="c", target="a", num_fewshot=2)
    task = build_task(load_task_spec(path), ByteTokenizer(), max_len=256, add_bos=False)
    contexts = [bytes(r.context).decode() for r in task.requests if r.choice == 0]
    assert contexts[0] == "the sky is blue\n\nwater is wet\n\none plus one is"
    assert contexts[1] == "one plus one is two\n\nwater is wet\n\nthe sky is"
    random_path = write_task(
        tmp_path,
        MC,
        context="{q}",
        choices="c",
        target="a",
        num_fewshot=1,
        fewshot_sampler="random",
    )
    task = build_task(load_task_spec(random_path), ByteTokenizer(), max_len=256, add_bos=False)
    for item, r in zip(MC, (r for r in task.requests if r.choice == 0)):
        shot, _ = bytes(r.context).decode().split("\n\n")
        assert not shot.startswith(item["q"])


@pytest.mark.parametrize(
    ("rows", "spec", "message"),
    [
        ([{"q": "x", "a": 0}], {"context": "{q}", "choices": "c", "target": "a"}, "no field 'c'"),
        (
            [{"c": ["a", "b"], "a": 0}],
            {"context": "{q}", "choices": "c", "target": "a"},
            "names 'q'",
        ),
        (
            [{"q": "x", "c": ["a", "b"], "a": 0}, {"q": "y", "c": ["a", "b", "c"], "a": 0}],
            {"context": "{q}", "choices": "c", "target": "a"},
            "3 choices where item 0 has 2",
        ),
        (
            [{"q": "x", "c": ["a", "b"], "a": 5}],
            {"context": "{q}", "choices": "c", "target": "a"},
            "= 5 but the item has 2 choices",
        ),
        (
            [{"q": "x", "c": ["a", "b"], "a": 0}, {"q": "y", "c": ["a", "b"], "a": 1}],
            {"context": "{q}", "choices": "c", "target": "a", "num_fewshot": 2},
            "num_fewshot = 2 but the task's own items less the one scored give(s) only 1",
        ),
        (
            [{"q": "x" * 300, "c": ["a", "b"], "a": 0}],
            {"context": "{q}", "choices": "c", "target": "a"},
            "longer than the model's 256",
        ),
    ],
    ids=[
        "missing-choices",
        "missing-template-field",
        "choice-count",
        "gold-out-of-range",
        "too-few-shots",
        "too-long",
    ],
)
def test_bad_items_are_refused_naming_the_file_and_item(tmp_path, rows, spec, message):
    path = write_task(tmp_path, rows, **spec)
    with pytest.raises(TaskError, match=r"items.jsonl|t.toml") as info:
        build_task(load_task_spec(path), ByteTokenizer(), max_len=256)
    assert message in str(info.value)


def test_bad_specs_are_refused(tmp_path):
    (tmp_path / "a.toml").write_text('name = "a"\nkind = "essay"\ndata = "x.jsonl"\n')
    with pytest.raises(TaskError, match="kind = 'essay' is not one of"):
        load_task_spec(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text('name = "b"\nkind = "perplexity"\ndata = "x"\ncontxt = ""\n')
    with pytest.raises(TaskError, match="unknown key.*contxt"):
        load_task_spec(tmp_path / "b.toml")
    with pytest.raises(TaskError, match="no such task spec"):
        load_task_spec(tmp_path / "missing.toml")


def test_requests_are_lm_evals():
    lm_utils = pytest.importorskip("lm_eval.utils", reason="the reference is lm-eval (dev group)")
    rng = random.Random(0)
    for n in (1, 5, 64, 65, 200, 513):
        tokens = [rng.randrange(256) for _ in range(n)]
        expected = [
            lm_utils.make_disjoint_window(w)
            for w in lm_utils.get_rolling_token_windows(tokens, 256, 64, 1)
        ]
        assert rolling_windows(tokens, 256, 64) == expected, n
    tok = ByteTokenizer()
    # The context's trailing space moves to the continuation; an empty context is BOS.
    assert encode_pair(tok, "Answer: ", "yes", False) == (list(b"Answer:"), list(b" yes"))
    assert encode_pair(tok, "", "yes", False) == ([256], list(b"yes"))


def test_scores_follow_lm_evals_definitions():
    from titan_data.eval_tasks import Item, Request, TaskSpec

    spec = TaskSpec(name="t", kind="multiple_choice", data="")
    items = [Item(gold=1, choice_chars=(1, 10)), Item(gold=0, choice_chars=(3, 3))]
    requests = [Request(i, c, (), ()) for i in range(2) for c in range(2)]
    # Item 0: choice 0 is likelier, choice 1 per character; item 1: a tie goes to the first.
    scores = score(Task(spec, items, requests), [-2.0, -5.0, -1.0, -1.0], [False] * 4)
    assert scores == {"acc": 0.5, "acc_norm": 1.0}


def test_task_file_writes_a_dataset_from_the_local_hub_cache(tmp_path):
    """A dataset the hub's file cache holds (as `hf download` leaves it) is written offline;
    one it lacks is an error saying nothing is downloaded."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    repo = tmp_path / "hf" / "hub" / "datasets--titan-test--tiny_mc"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision / "data").mkdir(parents=True)
    table = pa.table(
        {"question": ["1+1?", "2+2?"], "choices": [["2", "3"], ["5", "4"]], "answer": [0, 1]}
    )
    pq.write_table(table, repo / "snapshots" / revision / "data" / "test-00000-of-00001.parquet")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    cmd = [sys.executable, "-m", "titan_data.cli", "task-file", "--split", "test"]
    out = tmp_path / "tiny.jsonl"
    done = subprocess.run(
        [*cmd, "--dataset", "titan-test/tiny_mc", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == table.to_pylist()
    missing = subprocess.run(
        [*cmd, "--dataset", "titan-test/absent", "--out", str(tmp_path / "x.jsonl")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "titan-data never downloads" in missing.stderr


def test_the_byte_tokenizer_written_for_transformers_encodes_as_titan(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (dev group)")
    from titan_data.hf_tokenizer_files import write_hf_tokenizer

    write_hf_tokenizer(ByteTokenizer(), tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Héllo, wörld!\n\tπ <bos> <|endoftext|>"
    mine = ByteTokenizer().encode(text, bos=False, eos=False)
    assert theirs.encode(text, add_special_tokens=False) == mine
    assert theirs.encode(text) == [ByteTokenizer.bos_id, *mine]  # BOS first, as documents
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (256, 257, 258)
    assert theirs.decode(mine) == text
