"""Tokenizing a source once into a folder of token shards (`titan-data tokenize`; the format is
described in token_shards.py).

Documents are read in the source's order by the same readers training uses, encoded as
BOS + text + EOS by a pool of processes (in order), and appended to the current shard; a shard
is closed at the first document boundary past `shard_tokens`. Each closed shard is written to a
temporary name, renamed, and only then recorded in the index together with the reader's
position after its last document. An interrupted run (killed, out of time) therefore leaves
only whole shards in the index, and the same command resumes after the last of them, reading
on from that position: the folder it finishes holds the same bytes as an uninterrupted run's.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from titan_data.errors import SKIP_HINT, DataError
from titan_data.sources import Source, check_source, load_source
from titan_data.token_shards import (
    FORMAT,
    MANIFEST,
    VERSION,
    differences,
    dtype_for,
    read_manifest,
    shard_name,
    tokenizer_record,
    write_manifest,
)
from titan_data.tokenizer import load_tokenizer

BATCH_DOCUMENTS = 256  # documents handed to the pool at a time
_TOKENIZER = None  # the pool's tokenizer, inherited by fork


def _encode(text: str) -> np.ndarray:
    ids = _TOKENIZER.encode(text, bos=True, eos=True)
    return np.asarray(ids, dtype=np.int64)


def tokenize_source(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: str,
    out: str,
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    bad_rows: str = "error",
    max_shards: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `dataset` into `out` (see the module docstring); returns the index. Resumes
    a folder that an earlier run with the same arguments left unfinished; stops after
    `max_shards` new shards when given (run again to go on)."""
    global _TOKENIZER
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens = {shard_tokens}; use 1 or more")
    source = load_source(dataset, dataset_path, text_field)
    if not isinstance(source, Source):
        raise ValueError(f"dataset {dataset} is already a folder of tokens")
    check_source(source)  # an empty source, or a text field its rows lack
    _TOKENIZER = load_tokenizer(tokenizer)
    manifest = _start_manifest(source, dataset, dataset_path, text_field, tokenizer, shard_tokens)
    if os.path.exists(os.path.join(out, MANIFEST)):
        manifest = _resume_manifest(out, manifest)
        if manifest["complete"]:
            return manifest
    os.makedirs(out, exist_ok=True)
    _remove_unrecorded(out, manifest)
    writer = _ShardWriter(out, manifest, dtype_for(_TOKENIZER.vocab_size), max_shards)
    reader = source.open(0, 1)
    if manifest["shards"]:
        reader.load_state_dict(manifest["shards"][-1]["resume"]["reader"])
    bar = tqdm(
        desc=f"tokenizing {source.name}",
        unit=" docs",
        initial=writer.documents,
        disable=not progress,
        dynamic_ncols=True,
    )
    context = multiprocessing.get_context("fork")
    pool = context.Pool(workers) if workers > 1 else None
    try:
        counter = _Skipped(writer.skipped)
        for texts, marks in _batches(reader, source, bad_rows, counter):
            encoded = pool.map(_encode, texts, chunksize=16) if pool else map(_encode, texts)
            for ids, mark in zip(encoded, marks):
                writer.add(ids, mark)
                if writer.stopped:
                    break
            bar.update(len(texts))
            bar.set_postfix_str(f"{writer.tokens:,} tokens, {len(manifest['shards'])} shards")
            if writer.stopped:
                return manifest
        writer.finish((reader.state_dict(), counter.skipped))
    finally:
        # The last shard closes after the last batch: the bar ends with the final count.
        bar.set_postfix_str(f"{writer.tokens:,} tokens, {len(manifest['shards'])} shards")
        bar.close()
        if pool is not None:
            pool.terminate()
    return manifest


def _start_manifest(source, dataset, dataset_path, text_field, tokenizer, shard_tokens) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype_for(_TOKENIZER.vocab_size).str,
        "tokenizer": tokenizer_record(_TOKENIZER, tokenizer),
        "source": {
            "dataset": dataset,
            "dataset_path": dataset_path,
            "text_field": text_field,
            "description": source.description,
        },
        "shard_tokens": shard_tokens,
        "shards": [],
        "documents": 0,
        "tokens": 0,
        "skipped_rows": 0,
        "complete": False,
    }


def _resume_manifest(out: str, fresh: dict) -> dict:
    """The index an earlier run left, if it was made from the same source, tokenizer and shard
    size; DataError otherwise."""
    old = read_manifest(out)
    differ = differences(old, fresh, ("source", "tokenizer", "dtype", "shard_tokens"), "now")
    if differ:
        raise DataError(
            f"{out} holds tokens made with other settings: {'; '.join(differ)}\nuse another"
            " --out folder, or the settings it was made with to finish it"
        )
    return old


def _remove_unrecorded(out: str, manifest: dict) -> None:
    """Shards (or temporary files) of an interrupted run that the index does not list."""
    recorded = {s["file"] for s in manifest["shards"]}
    recorded |= {s["file"].replace(".bin", ".docs.npy") for s in manifest["shards"]}
    for name in os.listdir(out):
        if name.startswith("shard-") and name not in recorded or name.endswith(".tmp"):
            os.remove(os.path.join(out, name))


def _batches(reader, source: Source, bad_rows: str, counter: _Skipped) -> Iterator:
    """(texts, marks) in batches; a mark is (reader position, bad rows skipped) after its
    document. Bad rows stop the run or are counted; empty documents are left out."""
    texts, marks = [], []
    while (row := reader.next()) is not None:
        if row.bad:
            if bad_rows == "error":
                raise DataError(f"dataset {source.name}: {row.bad}\n{SKIP_HINT}")
            counter.skipped += 1
        if row.text:
            texts.append(row.text)
            marks.append((reader.state_dict(), counter.skipped))
        if len(texts) == BATCH_DOCUMENTS:
            yield texts, marks
            texts, marks = [], []
    if texts:
        yield texts, marks


class _Skipped:
    def __init__(self, skipped: int):
        self.skipped = skipped


class _ShardWriter:
    """Appends documents to the current shard; closes shards; keeps the index up to date."""

    def __init__(self, out: str, manifest: dict, dtype: np.dtype, max_shards: int | None):
        self.out, self.manifest, self.dtype = out, manifest, dtype
        self.limit = None if max_shards is None else len(manifest["shards"]) + max_shards
        self.parts: list[np.ndarray] = []
        self.current_documents = 0
        self.current_tokens = 0
        self.documents = int(manifest["documents"])
        self.tokens = int(manifest["tokens"])
        self.skipped = int(manifest["skipped_rows"])
        self.stopped = False

    def add(self, ids: np.ndarray, mark: tuple[dict, int]) -> None:
        self.parts.append(ids.astype(self.dtype))
        self.current_documents += 1
        self.current_tokens += len(ids)
        self.documents += 1
        self.tokens += len(ids)
        if self.current_tokens >= self.manifest["shard_tokens"]:
            self.close_shard(mark)

    def close_shard(self, mark: tuple[dict, int]) -> None:
        state, self.skipped = mark
        index = len(self.manifest["shards"])
        name = shard_name(index)
        tokens = np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
        offsets = np.cumsum([0] + [len(p) for p in self.parts], dtype=np.int64)
        _write_atomic(os.path.join(self.out, name), tokens.tobytes())
        docs = os.path.join(self.out, name.replace(".bin", ".docs.npy"))
        with open(docs + ".tmp", "wb") as f:
            np.save(f, offsets)
        os.replace(docs + ".tmp", docs)
        self.manifest["shards"].append(
            {
                "file": name,
                "documents": self.current_documents,
                "tokens": int(tokens.size),
                "max_id": int(tokens.max()) if tokens.size else -1,
                "resume": {"reader": state},
            }
        )
        self.manifest.update(
            documents=self.documents, tokens=self.tokens, skipped_rows=self.skipped
        )
        write_manifest(self.out, self.manifest)
        self.parts, self.current_documents, self.current_tokens = [], 0, 0
        if self.limit is not None and len(self.manifest["shards"]) >= self.limit:
            self.stopped = True

    def finish(self, mark: tuple[dict, int]) -> None:
        if self.parts:
            self.close_shard(mark)
        self.skipped = mark[1]
        self.manifest.update(
            documents=self.documents, tokens=self.tokens, skipped_rows=self.skipped, complete=True
        )
        write_manifest(self.out, self.manifest)


def _write_atomic(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
