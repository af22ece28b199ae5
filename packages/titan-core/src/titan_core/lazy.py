"""Lazy re-exports for a package's `__init__.py` (PEP 562): each name of its public API is
imported from its module on first use, so that importing one light module of a package
(`titan_core.config`, `titan_ckpt.config`) does not import all the others, and torch with
them. A trainer reads and checks its command line and TOML this way in a fraction of a second,
before torch's seconds of import.

The names stay written as imports, in an `if TYPE_CHECKING:` block of the `__init__.py`
(which type checkers and readers take as they are); `attach` reads that block once.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any


def attach(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for the package `package` whose `__init__.py` is
    `init_file`, from the `from MODULE import NAME` lines of its `if TYPE_CHECKING:` block.
    A name that is not re-exported but is a submodule is imported as one."""
    where = _typing_imports(Path(init_file))
    module = sys.modules[package]
    module.__class__ = _LazyPackage  # keeps a submodule from hiding an export of its name
    module._lazy_exports = where

    def __getattr__(name: str) -> Any:
        source = where.get(name)
        if source is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(source), name)
        object.__setattr__(module, name, value)  # resolved once
        return value

    def __dir__() -> list[str]:
        return sorted(set(where) | set(module.__dict__))

    return __getattr__, __dir__


class _LazyPackage(types.ModuleType):
    """A lazily re-exporting package. Importing its submodule `x` makes Python set the
    package's attribute `x` to the module; when `x` is also the name of a re-exported
    function (titan_parallel's `parallelize`, from `titan_parallel.parallelize`), that would
    hide the function, so the module is not bound there (it stays in `sys.modules`)."""

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if (
            isinstance(value, types.ModuleType)
            and name in exports
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            return
        super().__setattr__(name, value)


def _typing_imports(init_file: Path) -> dict[str, str]:
    """{name: module} of the `from MODULE import NAME` lines in `if TYPE_CHECKING:` blocks."""
    where = {}
    for node in ast.parse(init_file.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for item in node.body:
                if isinstance(item, ast.ImportFrom) and item.module:
                    for alias in item.names:
                        where[alias.asname or alias.name] = item.module
    return where
