"""Tokenize, pack and batch a document stream, with a state that resumes bit-exactly."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any, Literal

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from titan_core import Tokenizer, get_logger
from titan_data.sources import (
    BAD_ROW,
    DataError,
    Source,
    check_source,
    load_source,
    missing_field_message,
    scan_bad_rows,
)

log = get_logger("data")

STATE_VERSION = 1
_END = object()
BAD_ROWS = ("error", "skip")
_LOGGED_SKIPS = 5  # bad rows named in the log one by one; after that, every 1000th


class TitanDataLoader:
    """Yields `(inputs, labels)` int64 tensors of shape [batch_size, seq_len].

    Each document is encoded as BOS + text + EOS and appended to a token stream; the stream is
    cut into windows of seq_len + 1 tokens (a document continues into the next window), and a
    window gives inputs = window[:-1], labels = window[1:]. The data-parallel rank reads only
    its share of the documents.

    The loader is one stream: every `iter()` continues where the previous one stopped, and
    `state_dict()` describes the position after the last batch yielded. A fresh loader built
    with the same arguments and given that state yields exactly the batches that followed.

    A row that is not a text document (malformed JSON, invalid UTF-8, a missing or non-string
    text field) raises `DataError` naming it with `bad_rows="error"`, or is skipped and counted
    in `skipped_rows` with `bad_rows="skip"`. An epoch that yields no token is an error, never
    an endless loop.
    """

    def __init__(
        self,
        source: Source,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        bad_rows: Literal["error", "skip"] = "error",
    ):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        if bad_rows not in BAD_ROWS:
            raise ValueError(f"bad_rows = {bad_rows!r}; use one of {', '.join(BAD_ROWS)}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.bad_rows = bad_rows
        # Position in the stream; `state_dict` is exactly these fields.
        self._epoch = 0
        self._documents = 0  # documents read in this epoch, by this rank
        self._epoch_tokens = 0  # tokens those documents gave
        self._skipped = 0  # bad rows skipped, over the loader's whole life
        self._batches = 0
        self._tokens: list[int] = []  # tokens read but not yet batched start at _start
        self._start = 0
        self._dataset: datasets.IterableDataset | None = None
        self._documents_iter: Iterator[dict] | None = None
        self._resume_from: dict | None = None  # datasets' own state, applied at epoch start
        self._exhausted = False

    # ------------------------------------------------------------------ iteration

    def _open_epoch(self) -> None:
        dataset = split_dataset_by_node(
            self.source.build(), rank=self.dp_rank, world_size=self.dp_world_size
        )
        if self._resume_from is not None:
            dataset.load_state_dict(self._resume_from)
            self._resume_from = None
        self._dataset = dataset
        self._documents_iter = iter(dataset)

    @property
    def skipped_rows(self) -> int:
        """Rows skipped as not being documents (`bad_rows="skip"`), over the loader's life
        (carried through `state_dict`)."""
        return self._skipped

    def _read_document(self) -> bool:
        """Append the next document's tokens; False when a finite loader has run out."""
        if self._documents_iter is None:
            self._open_epoch()
        try:
            row = next(self._documents_iter, _END)
        except Exception as e:  # noqa: BLE001 - a reader's failure (pyarrow, network), named
            first = str(e).strip().splitlines()
            raise DataError(
                f"dataset {self.source.name} ({self.source.description}): reading the document after"
                f" number {self._documents} of epoch {self._epoch} on dp rank {self.dp_rank} failed:"
                f" {type(e).__name__}: {first[0] if first else ''}"
            ) from e
        if row is _END:
            if self._documents == 0:
                raise DataError(self._empty_message())
            if self._epoch_tokens == 0:
                raise DataError(self._no_tokens_message())
            if not self.infinite:
                return False
            log.info(
                "data: %s epoch %d ended after %d documents on dp rank %d; starting epoch %d",
                self.source.name,
                self._epoch,
                self._documents,
                self.dp_rank,
                self._epoch + 1,
            )
            self._epoch += 1
            self._documents = 0
            self._epoch_tokens = 0
            self._dataset = self._documents_iter = None
            return True
        self._documents += 1
        text = self._text_of(row)
        if text:
            tokens = self.tokenizer.encode(text, bos=True, eos=True)
            self._tokens.extend(tokens)
            self._epoch_tokens += len(tokens)
        return True

    def _text_of(self, row: dict) -> str | None:
        """The row's text, or None for an empty document or a skipped bad row."""
        bad = row.get(BAD_ROW)
        if bad:
            return self._bad_row(bad)
        field = self.source.text_field
        where = f"document {self._documents} of epoch {self._epoch} (dp rank {self.dp_rank})"
        if field not in row:
            return self._bad_row(f"{where}: {missing_field_message(self.source, row)}")
        text = row[field]
        if text is not None and not isinstance(text, str):
            return self._bad_row(f"{where}: field {field!r} holds {type(text).__name__}, not text")
        return text

    def _bad_row(self, what: str) -> None:
        if self.bad_rows == "error":
            raise DataError(
                f"dataset {self.source.name}: {what}\n"
                'fix or remove the row, or set bad_rows = "skip" to skip such rows and count them'
            )
        self._skipped += 1
        if self._skipped <= _LOGGED_SKIPS or self._skipped % 1000 == 0:
            log.warning("data: skipped bad row %d: %s", self._skipped, what)
        return None

    def _no_tokens_message(self) -> str:
        return (
            f"dataset {self.source.name} ({self.source.description}) gave dp rank {self.dp_rank}"
            f" {self._documents:,} documents and no token in a whole pass"
            + (
                f" ({self._skipped:,} bad rows skipped): no row was a text document"
                if self._skipped >= self._documents
                else (f" ({self._skipped:,} bad rows skipped)" if self._skipped else "")
                + ": every document is empty; point it at data with text"
            )
        )

    def _empty_message(self) -> str:
        where = f"dataset {self.source.name} ({self.source.description})"
        if self.dp_world_size > 1:
            return (
                f"{where} gave no documents to dp rank {self.dp_rank} of {self.dp_world_size}: "
                "it is empty or has fewer documents (or files) than data-parallel ranks"
            )
        return f"{where} is empty"

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        while not self._exhausted:
            if len(self._tokens) - self._start < window * self.batch_size:
                # Drop consumed tokens before growing, so the list stays about one batch long.
                del self._tokens[: self._start]
                self._start = 0
                while len(self._tokens) < window * self.batch_size:
                    if not self._read_document():
                        self._exhausted = True  # the tail shorter than one batch is dropped
                        return
            end = self._start + window * self.batch_size
            batch = torch.tensor(self._tokens[self._start : end], dtype=torch.int64)
            batch = batch.view(self.batch_size, window)
            self._start = end
            self._batches += 1
            yield batch[:, :-1], batch[:, 1:]

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        if self._dataset is not None:
            dataset_state = self._dataset.state_dict()
        else:  # between epochs, or resumed but not iterated yet
            dataset_state = copy.deepcopy(self._resume_from)
        return {
            "version": STATE_VERSION,
            "dataset": self.source.name,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "vocab_size": self.tokenizer.vocab_size,
            "epoch": self._epoch,
            "documents": self._documents,
            "epoch_tokens": self._epoch_tokens,
            "skipped_rows": self._skipped,
            "batches": self._batches,
            "tokens": self._tokens[self._start :],
            "source_state": dataset_state,
            "exhausted": self._exhausted,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict`; the loader must be built with the same dataset,
        tokenizer, sequence length, batch size and data-parallel layout."""
        expected = {
            "version": STATE_VERSION,
            "dataset": self.source.name,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "vocab_size": self.tokenizer.vocab_size,
        }
        wrong = [
            f"{key} {state_dict.get(key)!r} (this loader: {value!r})"
            for key, value in expected.items()
            if state_dict.get(key) != value
        ]
        if wrong:
            raise ValueError(
                "data loader state does not fit this loader: it was saved with "
                + ", ".join(wrong)
                + "; resume with the settings it was saved with, or start the data afresh"
            )
        self._epoch = int(state_dict["epoch"])
        self._documents = int(state_dict["documents"])
        # Absent from states saved before these were counted: count afresh.
        self._epoch_tokens = int(state_dict.get("epoch_tokens", 1))
        self._skipped = int(state_dict.get("skipped_rows", 0))
        self._batches = int(state_dict["batches"])
        self._tokens = list(state_dict["tokens"])
        self._start = 0
        self._resume_from = copy.deepcopy(state_dict["source_state"])
        self._dataset = self._documents_iter = None
        self._exhausted = bool(state_dict["exhausted"])

    def __repr__(self) -> str:
        return (
            f"TitanDataLoader({self.source.name}: {self.source.description}, "
            f"seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"dp {self.dp_rank}/{self.dp_world_size}, infinite={self.infinite}, "
            f"bad_rows={self.bad_rows})"
        )


def check_fills_a_batch(loader: TitanDataLoader) -> None:
    """Raise DataError unless one pass over `loader`'s share of the data fills one batch.

    Reads from the beginning, in a loader of its own, only as far as one batch: a source that
    is empty, holds only empty documents, or is too small would otherwise make an infinite
    loader cycle through epochs without ever yielding a batch."""
    probe = TitanDataLoader(
        loader.source,
        loader.tokenizer,
        seq_len=loader.seq_len,
        batch_size=loader.batch_size,
        dp_rank=loader.dp_rank,
        dp_world_size=loader.dp_world_size,
        infinite=False,
        bad_rows=loader.bad_rows,
    )
    if next(iter(probe), None) is not None:
        return
    need = loader.batch_size * (loader.seq_len + 1)
    skipped = f", {probe.skipped_rows:,} bad rows skipped" if probe.skipped_rows else ""
    raise DataError(
        f"dataset {loader.source.name} ({loader.source.description}) gives dp rank"
        f" {loader.dp_rank} of {loader.dp_world_size} {len(probe._tokens):,} tokens in a whole pass"
        f" ({probe._documents:,} documents{skipped}), fewer than one batch needs: batch_size"
        f" {loader.batch_size} x (seq_len {loader.seq_len} + 1) = {need:,}\n"
        "use more data, or a smaller seq_len or batch size"
    )


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
    text_field: str = "text",
    bad_rows: Literal["error", "skip"] = "error",
) -> TitanDataLoader:
    """A checkpointable loader of packed `(inputs, labels)` batches for one data-parallel rank.

    `dataset`/`dataset_path` take the forms listed in `titan_data.sources`; `text_field` is the
    column holding the text in jsonl/parquet/hub data. With `infinite` (the default) the data
    repeats in the same order, epoch after epoch; otherwise iteration stops when this rank's
    share runs out (the last partial batch is dropped).

    Checked here, before any batch: the source is not empty, its first row has the text field,
    this rank's share fills at least one batch, and (with `bad_rows="error"`) every row of
    local jsonl/json/text files is a text document; a bad one raises DataError naming file and
    line. With `bad_rows="skip"` bad rows are skipped and counted (`skipped_rows`).
    """
    source = load_source(dataset, dataset_path, text_field)
    check_source(source)
    if bad_rows == "error" and source.files:
        start = time.perf_counter()
        rows, bad = scan_bad_rows(source)
        if bad:
            raise DataError(
                f"dataset {source.name}: {bad}\n"
                'fix or remove the row, or set bad_rows = "skip" to skip such rows and count them'
            )
        seconds = time.perf_counter() - start
        if seconds > 1:
            log.info(
                "data: checked %s rows of %s in %.1fs", f"{rows:,}", source.description, seconds
            )
    loader = TitanDataLoader(
        source,
        tokenizer,
        seq_len=seq_len,
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        bad_rows=bad_rows,
    )
    check_fills_a_batch(loader)
    return loader
