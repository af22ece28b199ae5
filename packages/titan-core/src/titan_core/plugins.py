"""Finding plugins by name: Python entry points, or an explicit `module:attr` path."""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points
from typing import Any

MODELS = "titan.models"
DATA = "titan.data"
CHECKPOINTERS = "titan.checkpointers"
CONVERTERS = "titan.converters"
OPTIMIZERS = "titan.optimizers"
METRIC_SINKS = "titan.metric_sinks"
GROUPS = (MODELS, DATA, CHECKPOINTERS, CONVERTERS, OPTIMIZERS, METRIC_SINKS)


class PluginError(LookupError):
    pass


def available(group: str) -> dict[str, str]:
    """Installed plugins of a group: name -> `module:attr`."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def resolve(group: str, name: str) -> Any:
    """Load the object registered as `name` in `group`, or import `name` if it is `module:attr`.

    An unknown name raises PluginError listing what is installed and a close match.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise PluginError(
                f"cannot import {module_name!r} for {group} plugin {name!r}: {e}"
            ) from e
        obj: Any = module
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise PluginError(
                    f"module {module_name!r} has no attribute {attr!r} ({group} plugin {name!r})"
                ) from None
        return obj
    installed = available(group)
    if name not in installed:
        shown = ", ".join(sorted(installed)) or "none"
        close = difflib.get_close_matches(name, list(installed), n=1)
        hint = f"\ndid you mean {close[0]}?" if close else ""
        raise PluginError(
            f"no {group} plugin named {name!r}; installed: {shown}{hint}\n"
            "install a package that registers it under the entry-point group "
            f"{group!r}, or give an import path as module:attr"
        )
    (ep,) = [ep for ep in entry_points(group=group) if ep.name == name][:1]
    return ep.load()
