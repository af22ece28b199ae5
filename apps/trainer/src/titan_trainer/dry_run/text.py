"""How the dry run writes sizes: with the digits a size needs, shared by the report and the
suggestions."""

from __future__ import annotations


def gib_text(value: float) -> str:
    """A size in GiB with the digits it needs: never "0.0" for an amount that is not zero."""
    digits = 1
    while round(value, digits) == 0 and value != 0 and digits < 4:
        digits += 1
    return f"{value:.{digits}f}"
