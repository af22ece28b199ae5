"""Tokenize, pack and batch a document stream, with a state that resumes bit-exactly."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import datasets
import torch
from datasets.distributed import split_dataset_by_node

from titan_core import Tokenizer, get_logger
from titan_data.sources import Source, check_source, load_source, missing_field_message

log = get_logger("data")

STATE_VERSION = 1
_END = object()


class TitanDataLoader:
    """Yields `(inputs, labels)` int64 tensors of shape [batch_size, seq_len].

    Each document is encoded as BOS + text + EOS and appended to a token stream; the stream is
    cut into windows of seq_len + 1 tokens (a document continues into the next window), and a
    window gives inputs = window[:-1], labels = window[1:]. The data-parallel rank reads only
    its share of the documents.

    The loader is one stream: every `iter()` continues where the previous one stopped, and
    `state_dict()` describes the position after the last batch yielded. A fresh loader built
    with the same arguments and given that state yields exactly the batches that followed.
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
    ):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        # Position in the stream; `state_dict` is exactly these fields.
        self._epoch = 0
        self._documents = 0  # documents read in this epoch, by this rank
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

    def _read_document(self) -> bool:
        """Append the next document's tokens; False when a finite loader has run out."""
        if self._documents_iter is None:
            self._open_epoch()
        row = next(self._documents_iter, _END)
        if row is _END:
            if self._documents == 0:
                raise ValueError(self._empty_message())
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
            self._dataset = self._documents_iter = None
            return True
        text = self._text_of(row)
        self._documents += 1
        if text:
            self._tokens.extend(self.tokenizer.encode(text, bos=True, eos=True))
        return True

    def _text_of(self, row: dict) -> str | None:
        field = self.source.text_field
        if field not in row:
            raise ValueError(missing_field_message(self.source, row))
        text = row[field]
        if text is not None and not isinstance(text, str):
            raise ValueError(
                f"dataset {self.source.name}: field {field!r} holds {type(text).__name__}, "
                "not text; set text_field to the field that holds the text"
            )
        return text

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
            f"dp {self.dp_rank}/{self.dp_world_size}, infinite={self.infinite})"
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
) -> TitanDataLoader:
    """A checkpointable loader of packed `(inputs, labels)` batches for one data-parallel rank.

    `dataset`/`dataset_path` take the forms listed in `titan_data.sources`; `text_field` is the
    column holding the text in jsonl/parquet/hub data. With `infinite` (the default) the data
    repeats in the same order, epoch after epoch; otherwise iteration stops when this rank's
    share runs out (the last partial batch is dropped).
    """
    source = load_source(dataset, dataset_path, text_field)
    check_source(source)
    return TitanDataLoader(
        source,
        tokenizer,
        seq_len=seq_len,
        batch_size=batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
