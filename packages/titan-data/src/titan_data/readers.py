"""Document readers: one source's documents for one packing stream, with a position that can be
saved and restored exactly.

The global sample order (see `titan_data.order`) packs each source's documents into `slots`
independent streams; stream `slot` reads the documents whose index in the source is
`slot mod slots`. A reader yields those documents and nothing else:

- `ListReader`: an in-memory list (the embedded corpus); random access, so the position is
  one counter.
- `LineReader`: local jsonl/json/text files, read line by line by this package. The lines of
  other streams are skipped without being decoded; the position is (file, byte offset, line,
  document index), so a resumed reader seeks straight to it.
- `DatasetsReader`: anything Hugging Face `datasets` streams (hub datasets, parquet, local
  copies), split with the library's own `split_dataset_by_node` (whole shards per stream when
  the shard count divides by `slots`, otherwise every `slots`-th row) and resumed through the
  library's `state_dict`.

`next()` returns a `Row` or None at the end of the source (one pass); `restart()` begins the
next pass. A row that is not a text document carries `bad` (what is wrong, with file and
line where there is one) instead of text.
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from titan_data.lines import bad_document, json_document, open_file

if TYPE_CHECKING:
    import datasets


class Row(NamedTuple):
    text: str | None
    """The document's text; None for an empty document or a bad row."""
    bad: str | None = None
    """Why the row is not a text document (`file:line: what`), or None."""


class Reader(Protocol):
    """What every reader offers (see the module docstring)."""

    def next(self) -> Row | None: ...

    def restart(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ListReader:
    """Documents `slot`, `slot + slots`, ... of an in-memory list."""

    def __init__(self, documents: Sequence[str], slot: int, slots: int):
        self.documents, self.slot, self.slots = documents, slot, slots
        self.read = 0  # documents of this stream read in this pass

    def next(self) -> Row | None:
        index = self.slot + self.read * self.slots
        if index >= len(self.documents):
            return None
        self.read += 1
        return Row(self.documents[index])

    def restart(self) -> None:
        self.read = 0

    def state_dict(self) -> dict[str, Any]:
        return {"read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.read = int(state["read"])


class LineReader:
    """The documents of local jsonl/json (`fmt="json"`) or text (`fmt="text"`) files whose
    index, counted over all files in order, is `slot mod slots`. In jsonl files a document is a
    non-blank line; a `.json` file holding one list gives one document per element; a text file
    is one document."""

    def __init__(self, files: Sequence[str], fmt: str, text_field: str, slot: int, slots: int):
        self.files, self.fmt, self.text_field = list(files), fmt, text_field
        self.slot, self.slots = slot, slots
        self._handle: io.BufferedIOBase | None = None
        self._list: list | None = None  # the elements of a .json list file being read
        self.restart()

    def restart(self) -> None:
        self._close()
        self.file = 0  # index into files
        self.offset = 0  # bytes of the current file consumed (decompressed)
        self.line = 0  # lines (or list elements) of the current file consumed
        self.document = 0  # documents of every stream seen in this pass

    def _close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._list = None

    def _open(self) -> None:
        path = self.files[self.file]
        handle = open_file(path)
        if self.fmt == "json" and self.offset == 0 and self.line == 0:
            head = handle.peek(64)[:64].lstrip() if hasattr(handle, "peek") else b""
            if head.startswith(b"["):
                self._list = _json_list(path, handle.read(), self.text_field)
                handle.close()
                return
        elif self.fmt == "json" and self.offset == -1:  # resuming inside a .json list file
            self._list = _json_list(path, handle.read(), self.text_field)
            handle.close()
            return
        _skip_bytes(handle, self.offset)
        self._handle = handle

    def next(self) -> Row | None:
        while self.file < len(self.files):
            if self._handle is None and self._list is None:
                self._open()
            row = self._next_in_file()
            if row is not None:
                return row
            self._close()
            self.file += 1
            self.offset = self.line = 0
        return None

    def _mine(self) -> bool:
        mine = self.document % self.slots == self.slot
        self.document += 1
        return mine

    def _next_in_file(self) -> Row | None:
        path = self.files[self.file]
        if self._list is not None:
            self.offset = -1  # marks "inside a list file" in the saved position
            while self.line < len(self._list):
                element = self._list[self.line]
                self.line += 1
                if self._mine():
                    return element
            return None
        if self.fmt == "text":
            if self.line or not self._mine():  # one document per file; others' not read
                self.line = 1
                return None
            data = self._handle.read()
            self.line = 1
            self.offset += len(data)
            try:
                return Row(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                return Row(None, f"{path}:{line}: invalid UTF-8")
        for raw in self._handle:
            self.offset += len(raw)
            self.line += 1
            if not raw.strip():
                continue
            if not self._mine():
                continue  # another stream's document: not decoded at all
            return _json_line(path, self.line, raw, self.text_field)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "offset": self.offset,
            "line": self.line,
            "document": self.document,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._close()
        self.file, self.offset = int(state["file"]), int(state["offset"])
        self.line, self.document = int(state["line"]), int(state["document"])

    def __del__(self) -> None:
        self._close()


def _skip_bytes(handle, count: int) -> None:
    """Move `handle` `count` bytes on: a seek where the file allows it, else reading (a
    compressed file is decompressed up to there)."""
    if count <= 0:
        return
    try:
        handle.seek(count)
        return
    except (OSError, io.UnsupportedOperation):
        pass
    while count > 0:
        chunk = handle.read(min(count, 1 << 20))
        if not chunk:
            return
        count -= len(chunk)


def _json_line(path: str, number: int, raw: bytes, text_field: str) -> Row:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Row(None, f"{path}:{number}: invalid UTF-8 at byte {e.start + 1} of the line")
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        why = e.msg.removesuffix(" at")
        return Row(None, f"{path}:{number}: malformed JSON ({why} at column {e.colno})")
    return _row(json_document(f"{path}:{number}", value, text_field))


def _json_list(path: str, data: bytes, text_field: str) -> list[Row]:
    """The rows of a `.json` file holding one list; one bad row when it cannot be parsed."""
    try:
        values = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return [Row(None, f"{path}:{line}: invalid UTF-8")]
    except json.JSONDecodeError as e:
        why = e.msg.removesuffix(" at")
        return [Row(None, f"{path}:{e.lineno}: malformed JSON ({why} at column {e.colno})")]
    return [
        _row(json_document(f"{path} element {i}", value, text_field))
        for i, value in enumerate(values, 1)
    ]


def _row(document: tuple[str | None, str | None]) -> Row:
    text, bad = document
    return Row(text, bad)


class DatasetsReader:
    """Stream `slot` of `slots` of a Hugging Face `IterableDataset`, split by
    `split_dataset_by_node` and resumed through the library's own `state_dict`."""

    def __init__(
        self,
        build: Callable[[], datasets.IterableDataset],
        text_field: str,
        slot: int,
        slots: int,
        describe: Callable[[], str],
    ):
        self.build, self.text_field = build, text_field
        self.slot, self.slots = slot, slots
        self.describe = describe
        self._dataset: datasets.IterableDataset | None = None
        self._rows = None
        self._resume: dict | None = None
        self.read = 0  # rows of this stream read in this pass (for messages)

    def _open(self) -> None:
        from datasets.distributed import split_dataset_by_node  # noqa: PLC0415 - see sources.py

        dataset = split_dataset_by_node(self.build(), rank=self.slot, world_size=self.slots)
        if self._resume is not None:
            dataset.load_state_dict(self._resume)
            self._resume = None
        self._dataset = dataset
        # `iter(batch_size=1)` rather than `iter(dataset)`: inside a DataLoader worker the
        # latter would split the data again, by worker; this split is ours (see order.py).
        self._rows = dataset.iter(batch_size=1)

    def next(self) -> Row | None:
        if self._rows is None:
            self._open()
        try:
            batch = next(self._rows, None)
        except Exception as e:  # noqa: BLE001 - pyarrow, network: named, in one line
            first = str(e).strip().splitlines()
            stream = f" of stream {self.slot} of {self.slots}" if self.slots > 1 else ""
            raise ReadError(
                f"{self.describe()}: reading row {self.read + 1}{stream} failed:"
                f" {type(e).__name__}: {first[0] if first else ''}"
            ) from e
        if batch is None:
            return None
        self.read += 1
        row = {key: values[0] for key, values in batch.items()}
        if self.text_field not in row:
            found = ", ".join(map(repr, row)) or "none"
            return Row(
                None,
                f"row {self.read} of stream {self.slot}: has no field {self.text_field!r};"
                f" fields found: {found}",
            )
        text, bad = bad_document(row[self.text_field], self.text_field)
        if bad:
            return Row(None, f"row {self.read} of stream {self.slot}: {bad}")
        return Row(text)

    def restart(self) -> None:
        self._dataset = self._rows = None
        self._resume = None
        self.read = 0

    def state_dict(self) -> dict[str, Any]:
        position = self._dataset.state_dict() if self._dataset is not None else self._resume
        return {"dataset": copy.deepcopy(position), "read": self.read}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._dataset = self._rows = None
        self._resume = copy.deepcopy(state["dataset"])
        self.read = int(state["read"])


class ReadError(RuntimeError):
    """A reader could not read its source (turned into a `DataError` by the caller)."""
