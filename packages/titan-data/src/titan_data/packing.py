"""One packing stream: the documents of one source for one slot of the global batch (see
order.py), each encoded as BOS + text + EOS and cut into windows of `seq_len + 1` tokens.

A document continues into the next window; nothing is padded. The stream repeats its documents
epoch after epoch (`infinite`), or ends with its last whole window. Its state is the reader's
position, the tokens read but not yet cut, the epoch and the counters: small, and exact.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from titan_core import Tokenizer, get_logger
from titan_data.errors import BAD_ROWS, SKIP_HINT, DataError
from titan_data.readers import ReadError
from titan_data.sources import Source

log = get_logger("data")

_LOGGED_SKIPS = 5  # bad rows named in the log one by one; after that, every 1000th
__all__ = ["BAD_ROWS", "SKIP_HINT", "SlotStream"]


class SlotStream:
    """Packing stream `slot` of `slots` of `source` (see the module docstring)."""

    def __init__(
        self,
        source: Source,
        tokenizer: Tokenizer,
        *,
        slot: int,
        slots: int,
        seq_len: int,
        bad_rows: Literal["error", "skip"] = "error",
        infinite: bool = True,
        log_epochs: bool = False,
    ):
        self.source, self.tokenizer = source, tokenizer
        self.slot, self.slots, self.window = slot, slots, seq_len + 1
        self.bad_rows, self.infinite, self.log_epochs = bad_rows, infinite, log_epochs
        self.reader = source.open(slot, slots)
        self.epoch = 0
        self.documents = 0  # documents of this stream read in this epoch
        self.tokens = 0  # tokens they gave
        self.skipped = 0  # bad rows skipped, over the stream's whole life
        self.buffer: list[int] = []

    def next_window(self) -> np.ndarray | None:
        """The next `seq_len + 1` tokens as int64, or None when a finite stream has run out."""
        while len(self.buffer) < self.window:
            if not self._read_document():
                return None
        window = np.array(self.buffer[: self.window], dtype=np.int64)
        del self.buffer[: self.window]
        return window

    def _read_document(self) -> bool:
        try:
            row = self.reader.next()
        except ReadError as e:
            raise DataError(f"{e} (epoch {self.epoch})") from e
        if row is None:
            return self._end_of_epoch()
        self.documents += 1
        if row.bad:
            self._bad_row(row.bad)
        elif row.text:
            ids = self.tokenizer.encode(row.text, bos=True, eos=True)
            self.buffer.extend(ids)
            self.tokens += len(ids)
        return True

    def _end_of_epoch(self) -> bool:
        if self.documents == 0:
            raise DataError(self._no_documents_message())
        if self.tokens == 0:
            raise DataError(self._no_tokens_message())
        if not self.infinite:
            return False
        if self.log_epochs:
            log.info(
                "data: %s epoch %d of packing stream %d ended after %d documents; starting epoch %d",
                self.source.name,
                self.epoch,
                self.slot,
                self.documents,
                self.epoch + 1,
            )
        self.epoch += 1
        self.documents = self.tokens = 0
        self.reader.restart()
        return True

    def _bad_row(self, what: str) -> None:
        if self.bad_rows == "error":
            raise DataError(f"dataset {self.source.name}: {what}\n{SKIP_HINT}")
        self.skipped += 1
        if self.skipped <= _LOGGED_SKIPS or self.skipped % 1000 == 0:
            log.warning("data: skipped bad row %d of stream %d: %s", self.skipped, self.slot, what)

    def _where(self) -> str:
        return f"dataset {self.source.name} ({self.source.description})"

    def _no_documents_message(self) -> str:
        if self.slots == 1:
            return f"{self._where()} is empty"
        return (
            f"{self._where()} gives packing stream {self.slot} of {self.slots} no documents: it"
            f" holds fewer documents (or shards) than the global batch has samples"
            f" ({self.slots})\nuse more data or a smaller global batch, or tokenize it with"
            " `titan-data tokenize` (tokens are packed across all documents)"
        )

    def _no_tokens_message(self) -> str:
        skipped = f" ({self.skipped:,} bad rows skipped)" if self.skipped else ""
        why = (
            ": no row was a text document"
            if self.skipped >= self.documents
            else ": every document is empty; point it at data with text"
        )
        return (
            f"{self._where()} gave packing stream {self.slot} of {self.slots}"
            f" {self.documents:,} documents and no token in a whole pass{skipped}{why}"
        )

    def too_small_message(self) -> str:
        """For a stream whose whole pass did not fill one window (see `check_streams`)."""
        skipped = f", {self.skipped:,} bad rows skipped" if self.skipped else ""
        return (
            f"{self._where()} gives packing stream {self.slot} of {self.slots} {self.tokens:,}"
            f" tokens in a whole pass ({self.documents:,} documents{skipped}), fewer than one"
            f" sample needs: seq_len {self.window - 1} + 1 = {self.window:,}\nuse more data, a"
            " smaller seq_len or global batch, or tokenize it with `titan-data tokenize`"
            " (tokens are packed across all documents)"
        )

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "reader": self.reader.state_dict(),
            "epoch": self.epoch,
            "documents": self.documents,
            "tokens": self.tokens,
            "skipped": self.skipped,
            "buffer": list(self.buffer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reader.load_state_dict(state["reader"])
        self.epoch = int(state["epoch"])
        self.documents, self.tokens = int(state["documents"]), int(state["tokens"])
        self.skipped = int(state["skipped"])
        self.buffer = list(state["buffer"])
