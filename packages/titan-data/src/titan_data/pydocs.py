"""The embedded default corpus: English documentation that every Python installation carries.

Documents are the `pydoc_data.topics` help texts (the language reference behind `help()`)
followed by one document per standard-library module made of its docstrings. Nothing is
downloaded or cached on disk; the corpus takes about a second to build once per process and
holds roughly 1.4 MB of text (the exact content follows the Python version).

It has two disjoint splits: `validation` holds one document in `VALIDATION_ONE_IN` (about 10%
of the text), chosen by a hash of the document's text, so the choice does not depend on the
documents' order and a document stays on its side when others change; `train` holds the rest.
The dataset names `pydocs` and `pydocs_validation` read them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import warnings
import zlib
from typing import Literal

# Modules whose import has side effects (opens a browser, prints, changes the terminal) or
# that are test/tooling code rather than documentation.
_SKIP_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "test",
        "readline",
        "rlcompleter",
        "ensurepip",
        "venv",
        "pydoc_data",
        "lib2to3",
    }
)
_MIN_DOC_CHARS = 40  # one-line stubs ("Return self+value.") add repetition, not language


def _module_document(name: str, seen: set[str]) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except Exception:  # not built on this platform (e.g. winreg on Linux)
        return ""
    parts: list[str] = []

    def add(title: str, doc: object) -> None:
        if not isinstance(doc, str):
            return
        doc = inspect.cleandoc(doc)
        if len(doc) >= _MIN_DOC_CHARS and doc not in seen:
            seen.add(doc)
            parts.append(f"{title}\n\n{doc}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        add(f"Module {name}", module.__doc__)
        members = vars(module)
        for attr in sorted(members):
            obj = members[attr]
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if getattr(obj, "__module__", name) not in (name, f"_{name}"):
                continue  # re-exported from elsewhere; documented with its home module
            add(f"{name}.{attr}", obj.__doc__)
            if inspect.isclass(obj):
                for meth, value in sorted(vars(obj).items()):
                    if not meth.startswith("_"):
                        add(f"{name}.{attr}.{meth}", getattr(value, "__doc__", None))
    return "\n\n".join(parts)


VALIDATION_ONE_IN = 8
"""The validation split holds the documents whose CRC-32 is a multiple of this."""

Split = Literal["all", "train", "validation"]


def _in_validation(document: str) -> bool:
    return zlib.crc32(document.encode()) % VALIDATION_ONE_IN == 0


@functools.cache
def pydocs_documents(split: Split = "all") -> tuple[str, ...]:
    """The corpus (`all`), or one of its disjoint splits (`train`, `validation`), in a fixed
    order, without duplicate texts."""
    if split == "all":
        return _all_documents()
    if split not in ("train", "validation"):
        raise ValueError(f"unknown pydocs split {split!r}; use all, train or validation")
    held_out = split == "validation"
    return tuple(doc for doc in _all_documents() if _in_validation(doc) == held_out)


@functools.cache
def _all_documents() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    seen: set[str] = set()
    documents = []
    for key in sorted(topics):
        text = topics[key].strip()
        if text and text not in seen:
            seen.add(text)
            documents.append(text)
    modules = sorted(
        n for n in sys.stdlib_module_names if not n.startswith("_") and n not in _SKIP_MODULES
    )
    for name in modules:
        document = _module_document(name, seen)
        if document:
            documents.append(document)
    return tuple(documents)
