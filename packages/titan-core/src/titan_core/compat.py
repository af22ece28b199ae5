"""What the installed torch offers beyond the oldest torch Titan supports (2.11).

Titan runs on torch 2.11, the torch that GPU machines in use ship, and on every newer release
its pyprojects admit. A feature that a newer torch adds is looked up where it is used (an
attribute, a keyword argument); without it the code takes the older way, and `note_missing`
says once per process, in the log, what is off or done differently and why.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch

from titan_core.log import get_logger

_noted: set[str] = set()


def note_missing(feature: str, consequence: str, *, off: bool = False) -> None:
    """Log once per process that this torch lacks `feature`, and what that means
    (`consequence`): a warning when something is `off` (the user can act: a newer torch), else
    an info line (an older way does the same)."""
    if feature in _noted:
        return
    _noted.add(feature)
    level = logging.WARNING if off else logging.INFO
    get_logger("compat").log(
        level, "torch %s has no %s: %s", torch.__version__, feature, consequence
    )


def accepts(fn: Callable, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (a parameter a newer torch added)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
