"""What every reader shares about a row: opening (possibly compressed) local files, and telling
a text document from a row that is not one."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma


def open_file(path: str) -> io.BufferedIOBase:
    """`path` opened for binary reading, decompressed by its extension (.gz, .bz2, .xz, .zst)."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith(".bz2"):
        return bz2.open(path, "rb")
    if lower.endswith(".xz"):
        return lzma.open(path, "rb")
    if lower.endswith(".zst"):
        try:
            import zstandard  # noqa: PLC0415 - optional, only for .zst files
        except ImportError:
            raise ImportError(
                f"reading {path} needs the zstandard package: pip install zstandard"
            ) from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def bad_document(text: object, text_field: str) -> tuple[str | None, str | None]:
    """(text, None) for a string or None (an empty document); (None, why) otherwise."""
    if text is None or isinstance(text, str):
        return text, None
    return None, f"field {text_field!r} holds {type(text).__name__}, not text"


def json_document(where: str, value: object, text_field: str) -> tuple[str | None, str | None]:
    """The text of one parsed JSON value, or why it is not a document (prefixed by `where`)."""
    if not isinstance(value, dict):
        kind = type(value).__name__
        return None, f"{where}: a JSON {kind}, not an object with a {text_field!r} field"
    if text_field not in value:
        found = ", ".join(map(repr, value)) or "none"
        return None, f"{where}: has no field {text_field!r}; fields found: {found}"
    text, bad = bad_document(value[text_field], text_field)
    return text, (f"{where}: {bad}" if bad else None)
