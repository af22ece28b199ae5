"""Evaluation tasks from local files, scored as lm-evaluation-harness scores them.

A task is a small TOML spec beside a JSONL or Parquet file of items; nothing is fetched at run
time. Three kinds:

- `multiple_choice` (HellaSwag, ARC, PIQA, MMLU, ...): each choice is scored by the
  log-likelihood of `target_delimiter + choice` after the context; `acc` is right when the
  most likely choice is the gold one, `acc_norm` when the most likely per character of the
  choice is (lm-eval's definitions, ties to the first choice).
- `last_word` (LAMBADA-style): the text's last word after the rest; `acc` when every token of
  it is the model's top choice, `perplexity` = exp(-mean log-likelihood).
- `perplexity` (WikiText-style): each text scored whole in disjoint windows of the model's
  context (lm-eval's rolling log-likelihood); `word_perplexity`, `byte_perplexity`,
  `bits_per_byte`.

A spec (field names are the item's keys; templates are Python format strings over the item,
`{question}` or `{choices[text][0]}`):

    name = "arc_easy"
    kind = "multiple_choice"
    data = "arc_easy.jsonl"          # beside the spec, or absolute
    context = "Question: {question}\\nAnswer:"
    choices = "choices.text"         # a field holding the list, or a list of templates
    target = "answerKey"             # the gold choice: an index, or a label/choice text
    labels = "choices.label"         # optional: the labels `target` names
    num_fewshot = 0
    fewshot_data = ""                # default: the task's own items, the scored one left out
    fewshot_sampler = "first_n"      # or "random" (lm-eval's seeded sampler)

Requests are tokenized as lm-eval's causal `hf` model does (`encode_pair`): trailing spaces of
the context move to the continuation, the pair is encoded whole and the continuation is what
follows the context's tokens, each text encoded as the tokenizer encodes a document (BOS first
where it adds one: lm-eval's default); an empty context is the tokenizer's BOS.
"""

from __future__ import annotations

import json
import math
import random
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

KINDS = ("multiple_choice", "last_word", "perplexity")

METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "last_word": ("acc", "perplexity"),
    "perplexity": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
}
"""The scores each kind reports, by lm-eval's names."""


class TaskError(ValueError):
    """A task spec or task file that cannot be evaluated; the message names the file, the item
    and the fix."""


@dataclass(frozen=True)
class TaskSpec:
    name: str
    """The task's name in logs, metrics (`eval/<name>/acc`) and result files."""
    kind: str
    """multiple_choice, last_word or perplexity."""
    data: str
    """The items: a .jsonl or .parquet file, relative to the spec's folder or absolute."""
    context: str = ""
    """multiple_choice: the template of the question the choices follow."""
    choices: str | list[str] = "choices"
    """multiple_choice: the field (dotted path) holding the list of choices, or a list of
    templates, one per choice."""
    target: str = "label"
    """multiple_choice: the field (dotted path) naming the gold choice: its index (an int or
    digits), or a label from `labels`, or the choice's text."""
    labels: str = ""
    """multiple_choice: the field (dotted path) holding the labels `target` names (ARC's
    `choices.label`); empty when `target` is an index or the choice's text."""
    text: str = "{text}"
    """last_word and perplexity: the template of the text."""
    target_delimiter: str = " "
    """What goes between the context and a choice (lm-eval's target_delimiter)."""
    fewshot_delimiter: str = "\n\n"
    """What ends each few-shot example (lm-eval's fewshot_delimiter)."""
    description: str = ""
    """Text put before the few-shot examples (lm-eval's description)."""
    num_fewshot: int = 0
    """Solved examples put before each item."""
    fewshot_data: str = ""
    """Where the examples come from (a file as `data`); empty: the task's own items, never
    the item being scored."""
    fewshot_sampler: str = "first_n"
    """first_n: the first examples in order; random: lm-eval's default sampler (one
    random.Random(fewshot_seed) drawing for each item in turn)."""
    fewshot_seed: int = 1234
    """The random sampler's seed (lm-eval's default)."""
    path: str = field(default="", compare=False)
    """The spec file this was read from (set by `load_task_spec`)."""


@dataclass(frozen=True)
class Request:
    """One scored continuation: its item, the choice it is (0 unless multiple_choice), the
    context's and the continuation's token ids."""

    item: int
    choice: int
    context: tuple[int, ...]
    continuation: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens the model reads: context and continuation, less the last token."""
        return len(self.context) + len(self.continuation) - 1


@dataclass
class Item:
    """What scoring an item needs besides its requests' log-likelihoods."""

    gold: int = -1
    choice_chars: tuple[int, ...] = ()
    words: int = 0
    bytes: int = 0


@dataclass
class Task:
    spec: TaskSpec
    items: list[Item]
    requests: list[Request]

    @property
    def longest(self) -> int:
        return max((r.length for r in self.requests), default=0)


# ---------------------------------------------------------------------------- spec and data


def load_task_spec(path: str | Path) -> TaskSpec:
    """Read a task spec (TOML); unknown keys, a missing name/kind/data and a wrong kind are
    errors naming the file."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task spec; give the path of a task's .toml file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskError(f"{path}: not valid TOML ({e})") from e
    known = {f.name for f in fields(TaskSpec)} - {"path"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TaskError(
            f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    missing = [k for k in ("name", "kind", "data") if k not in raw]
    if missing:
        raise TaskError(f"{path}: missing {', '.join(missing)}")
    spec = TaskSpec(**raw, path=str(path))
    if spec.kind not in KINDS:
        raise TaskError(f"{path}: kind = {spec.kind!r} is not one of {', '.join(KINDS)}")
    if spec.num_fewshot < 0:
        raise TaskError(f"{path}: num_fewshot = {spec.num_fewshot}; use 0 or more")
    if spec.fewshot_sampler not in ("first_n", "random"):
        raise TaskError(
            f"{path}: fewshot_sampler = {spec.fewshot_sampler!r}; use first_n or random"
        )
    return spec


def read_items(file: str | Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl or .parquet file, as dicts."""
    file = Path(file)
    if not file.is_file():
        raise TaskError(f"{file}: no such task file")
    if file.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TaskError(f"{file}, line {n}: not JSON ({e})") from e
        return rows
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    raise TaskError(f"{file}: a task file is .jsonl or .parquet")


def _beside(spec: TaskSpec, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() or not spec.path else Path(spec.path).parent / p


def write_task_file(
    dataset: str, split: str, out: str | Path, *, name: str | None = None, limit: int | None = None
) -> int:
    """Write `split` of `dataset` (a Hugging Face dataset already in the local cache, or a
    local folder or file `datasets` reads) to `out` (.jsonl or .parquet); returns the rows
    written. Runs `datasets` offline: nothing is downloaded."""
    import os

    out = Path(out)
    if out.suffix not in (".jsonl", ".parquet"):
        raise TaskError(f"{out}: a task file is .jsonl or .parquet")
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    try:
        try:
            rows = datasets.load_dataset(dataset, name, split=split)
        except (ValueError, FileNotFoundError, ConnectionError):
            # Not in `datasets`' own cache: the hub's file cache (what `hf download` or an
            # earlier `load_dataset` left under HF_HOME/hub), read as a local folder.
            from huggingface_hub import snapshot_download

            folder = snapshot_download(dataset, repo_type="dataset", local_files_only=True)
            rows = datasets.load_dataset(folder, name, split=split)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        raise TaskError(
            f"{dataset} ({name or 'default'}, {split}) is not on this machine: {e}\n"
            "titan-data never downloads; fetch it once where the network is, e.g."
            f' `python -c "import datasets; datasets.load_dataset({dataset!r}, {name!r})"`,'
            " or give a local folder or file"
        ) from e
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        rows.to_parquet(str(out))
    else:
        with open(out, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    return len(rows)


# ---------------------------------------------------------------------------- rendering


def _field(item: dict[str, Any], path: str, where: str) -> Any:
    value: Any = item
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise TaskError(
                f"{where}: no field {path!r} (the item has {', '.join(map(str, item))})"
            )
    return value


def _render(template: str, item: dict[str, Any], where: str) -> str:
    try:
        return template.format_map(item)
    except (KeyError, IndexError, AttributeError) as e:
        raise TaskError(
            f"{where}: the template {template!r} names {e} that the item lacks (it has"
            f" {', '.join(map(str, item))})"
        ) from e


def choices_of(spec: TaskSpec, item: dict[str, Any], where: str) -> list[str]:
    if isinstance(spec.choices, list):
        return [_render(t, item, where) for t in spec.choices]
    value = _field(item, spec.choices, where)
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise TaskError(f"{where}: field {spec.choices!r} is not a list of strings")
    return value


def gold_of(spec: TaskSpec, item: dict[str, Any], choices: list[str], where: str) -> int:
    value = _field(item, spec.target, where)
    if isinstance(value, bool):
        raise TaskError(f"{where}: target {spec.target!r} is a boolean; use an index or a label")
    if isinstance(value, str) and value.strip().isdigit() and not spec.labels:
        value = int(value)
    if isinstance(value, int):
        index = value
    elif spec.labels:
        labels = _field(item, spec.labels, where)
        if value not in labels:
            raise TaskError(f"{where}: target {value!r} is not one of the labels {labels}")
        index = labels.index(value)
    elif value in choices:
        index = choices.index(value)
    else:
        raise TaskError(f"{where}: target {value!r} is neither an index nor one of the choices")
    if not 0 <= index < len(choices):
        raise TaskError(
            f"{where}: target {spec.target!r} = {index} but the item has {len(choices)} choices"
        )
    return index


def split_last_word(text: str) -> tuple[str, str]:
    """LAMBADA's split: the text before its last space, and the last word with that space."""
    head, _, last = text.rpartition(" ")
    return head, " " + last


def question_and_answer(spec: TaskSpec, item: dict[str, Any], where: str) -> tuple[str, str]:
    """The item's context and its right answer (with its delimiter), as a few-shot example."""
    if spec.kind == "multiple_choice":
        choices = choices_of(spec, item, where)
        return _render(spec.context, item, where), spec.target_delimiter + choices[
            gold_of(spec, item, choices, where)
        ]
    head, last = split_last_word(_render(spec.text, item, where))
    return head, last


class FewShot:
    """The solved examples put before each item, drawn as lm-eval draws them."""

    def __init__(self, spec: TaskSpec, own: list[dict[str, Any]]):
        self.spec = spec
        self.same_split = not spec.fewshot_data
        self.pool = own if self.same_split else read_items(_beside(spec, spec.fewshot_data))
        self.rnd = random.Random(spec.fewshot_seed)
        available = len(self.pool) - (1 if self.same_split else 0)
        if spec.num_fewshot > available:
            source = (
                "the task's own items less the one scored" if self.same_split else spec.fewshot_data
            )
            raise TaskError(
                f"{spec.path or spec.name}: num_fewshot = {spec.num_fewshot} but {source} give(s)"
                f" only {available} example(s); lower num_fewshot or give fewshot_data more items"
            )

    def examples(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        n = self.spec.num_fewshot
        if n == 0:
            return []
        if self.spec.fewshot_sampler == "first_n":
            pool = [d for d in self.pool if d != item] if self.same_split else self.pool
            return pool[:n]
        if not self.same_split:
            return self.rnd.sample(self.pool, n)
        drawn = [d for d in self.rnd.sample(self.pool, n + 1) if d != item][:n]
        if len(drawn) < n:  # the item was in the pool more than once
            drawn = self.rnd.sample([d for d in self.pool if d != item], n)
        return drawn

    def prefix(self, item: dict[str, Any], where: str) -> str:
        parts = (
            [self.spec.description + self.spec.fewshot_delimiter] if self.spec.description else []
        )
        for example in self.examples(item):
            q, a = question_and_answer(self.spec, example, f"{where} (few-shot example)")
            parts.append(q + a + self.spec.fewshot_delimiter)
        return "".join(parts)


# ---------------------------------------------------------------------------- requests


def encode_pair(
    tokenizer, context: str, continuation: str, add_bos: bool
) -> tuple[list[int], list[int]]:
    """lm-eval's causal `encode_pair`: the context's trailing spaces move to the continuation;
    the continuation's tokens are those of the whole text after the context's (both encoded
    with BOS first when `add_bos`). An empty context is BOS alone."""
    if not context:
        tokens = tokenizer.encode(continuation, bos=False, eos=False)
        if tokens and tokens[0] == tokenizer.bos_id:
            return tokens[:1], tokens[1:]
        return [tokenizer.bos_id], tokens
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=add_bos, eos=False)
    head = tokenizer.encode(context, bos=add_bos, eos=False)
    return head, whole[len(head) :]


def rolling_windows(
    tokens: list[int], prefix: int, max_len: int
) -> list[tuple[list[int], list[int]]]:
    """lm-eval's rolling log-likelihood windows (context length 1): disjoint runs of at most
    `max_len` predicted tokens, each read after as much of the text before it as fits; the
    first after `prefix` (BOS)."""
    windows = []
    done = 0
    while done < len(tokens):
        n = min(max_len, len(tokens) - done)
        end = done + n
        if done == 0:
            inputs = [prefix] + tokens[: n - 1]
        else:
            inputs = tokens[max(0, end - max_len - 1) : end - 1]
        # lm-eval's make_disjoint_window: the context is what the inputs hold before the run.
        windows.append((inputs[: len(inputs) - (n - 1)], tokens[done:end]))
        done = end
    return windows


def uses_bos(tokenizer, add_bos: bool) -> bool:
    """Whether texts are encoded with BOS first: asked for, and the tokenizer starts documents
    with one (a Hugging Face tokenizer without a BOS of its own, Qwen's, does not; lm-eval's
    default encodes as the tokenizer does)."""
    return add_bos and getattr(tokenizer, "adds_bos", True)


def build_task(
    spec: TaskSpec, tokenizer, *, max_len: int, max_items: int = -1, add_bos: bool = True
) -> Task:
    """The task's items and requests, checked: every field present, every gold index within
    its choices, every choice list as long as the first item's, every request within
    `max_len` tokens (the model's context). `add_bos`: see `uses_bos`."""
    file = _beside(spec, spec.data)
    rows = read_items(file)
    if not rows:
        raise TaskError(f"{file}: no items")
    # Few-shot examples come from every item (as lm-eval's `limit` leaves its pool whole).
    fewshot = FewShot(spec, rows) if spec.kind != "perplexity" else None
    if max_items > 0:
        rows = rows[:max_items]
    add_bos = uses_bos(tokenizer, add_bos)
    items, requests = [], []
    n_choices = None
    for i, row in enumerate(rows):
        where = f"{file}, item {i}"
        prefix = fewshot.prefix(row, where) if fewshot is not None else ""
        if spec.kind == "multiple_choice":
            choices = choices_of(spec, row, where)
            if n_choices is None:
                n_choices = len(choices)
            if len(choices) != n_choices or len(choices) < 2:
                raise TaskError(
                    f"{where}: {len(choices)} choices where item 0 has {n_choices}; every item of"
                    " a multiple-choice task needs the same number (at least 2)"
                )
            gold = gold_of(spec, row, choices, where)
            context = prefix + _render(spec.context, row, where)
            for c, choice in enumerate(choices):
                ctx, cont = encode_pair(tokenizer, context, spec.target_delimiter + choice, add_bos)
                requests.append(Request(i, c, tuple(ctx), tuple(cont)))
            items.append(Item(gold=gold, choice_chars=tuple(len(c) for c in choices)))
        elif spec.kind == "last_word":
            head, last = split_last_word(_render(spec.text, row, where))
            ctx, cont = encode_pair(tokenizer, prefix + head, last, add_bos)
            requests.append(Request(i, 0, tuple(ctx), tuple(cont)))
            items.append(Item())
        else:
            text = _render(spec.text, row, where)
            tokens = tokenizer.encode(text, bos=add_bos, eos=False)
            for ctx, cont in rolling_windows(tokens, tokenizer.bos_id, max_len):
                requests.append(Request(i, 0, tuple(ctx), tuple(cont)))
            items.append(Item(words=len(re.split(r"\s+", text)), bytes=len(text.encode("utf-8"))))
    task = Task(spec, items, requests)
    too_long = [r for r in requests if r.length > max_len]
    if too_long:
        worst = max(too_long, key=lambda r: r.length)
        raise TaskError(
            f"{file}, item {worst.item}: {worst.length + 1} tokens with its context, longer than"
            f" the model's {max_len}; drop the long items, lower num_fewshot, or evaluate with a"
            " longer training.seq_len"
        )
    return task


# ---------------------------------------------------------------------------- scores


def score(task: Task, loglik: Sequence[float], greedy: Sequence[bool]) -> dict[str, float]:
    """The task's metrics from each request's log-likelihood and whether every continuation
    token was the model's top choice (in `task.requests` order)."""
    kind = task.spec.kind
    if kind == "multiple_choice":
        per_item: dict[int, list[float]] = {}
        for r, ll in zip(task.requests, loglik):
            per_item.setdefault(r.item, []).append(ll)
        acc = acc_norm = 0
        for i, item in enumerate(task.items):
            lls = per_item[i]
            acc += _argmax(lls) == item.gold
            acc_norm += _argmax([ll / n for ll, n in zip(lls, item.choice_chars)]) == item.gold
        n = len(task.items)
        return {"acc": acc / n, "acc_norm": acc_norm / n}
    if kind == "last_word":
        n = len(task.items)
        return {
            "acc": sum(bool(g) for g in greedy) / n,
            "perplexity": math.exp(-sum(loglik) / n),
        }
    total = {}
    for r, ll in zip(task.requests, loglik):
        total[r.item] = total.get(r.item, 0.0) + ll
    ll_sum = sum(total.values())
    words = sum(item.words for item in task.items)
    nbytes = sum(item.bytes for item in task.items)
    return {
        "word_perplexity": math.exp(-ll_sum / words),
        "byte_perplexity": math.exp(-ll_sum / nbytes),
        "bits_per_byte": -ll_sum / nbytes / math.log(2),
    }


def samples(task: Task, loglik: Sequence[float], greedy: Sequence[bool]) -> list[dict[str, Any]]:
    """Each item's log-likelihoods and outcome (lm-eval's log_samples), in item order."""
    rows: list[dict[str, Any]] = [{"item": i} for i in range(len(task.items))]
    for r, ll, g in zip(task.requests, loglik, greedy):
        row = rows[r.item]
        row.setdefault("loglik", []).append(ll)
        row.setdefault("greedy", []).append(bool(g))
    for row, item in zip(rows, task.items):
        if task.spec.kind == "multiple_choice":
            lls = row["loglik"]
            row["gold"] = item.gold
            row["pred"] = _argmax(lls)
            row["pred_norm"] = _argmax([ll / n for ll, n in zip(lls, item.choice_chars)])
            row["acc"] = float(row["pred"] == item.gold)
            row["acc_norm"] = float(row["pred_norm"] == item.gold)
        elif task.spec.kind == "last_word":
            row["loglik"], row["greedy"] = row["loglik"][0], row["greedy"][0]
        else:
            row["loglik"] = sum(row["loglik"])
            row["words"], row["bytes"] = item.words, item.bytes
            del row["greedy"]
    return rows


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-eval uses)."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best
