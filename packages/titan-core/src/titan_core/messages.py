"""Pieces of the messages people read that every package writes: the part of a library's
error worth quoting, and a list cut short."""

from __future__ import annotations

from collections.abc import Sequence


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when the message is empty:
    what a one-line error message can quote of an error a library raised."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def shortlist(items: Sequence[str], most: int, sep: str = ", ") -> str:
    """The first `most` of `items` joined by `sep`, and " ..." when there are more."""
    return sep.join(items[:most]) + (" ..." if len(items) > most else "")
