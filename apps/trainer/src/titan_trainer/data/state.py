"""The data loader's place in the checkpoint, and the keyword arguments a data plugin takes.

A loader whose state is a position in a global sample order (`merge_state_dicts`, see
`titan_core.StatefulLoader`) is checkpointed as that one global position: at save time the
data-parallel ranks' parts are gathered and merged, every rank holds the same state, and the
checkpointer stores one copy that a job with any data-parallel degree resumes from. Other
loaders keep their per-rank state.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist

from titan_core import GLOBAL_STATE, get_logger

log = get_logger("data")


class GlobalLoaderState:
    """What the checkpointer saves for `loader`: its parts merged over `dp_group`."""

    def __init__(self, loader, dp_group=None):
        self.loader = loader
        self.dp_group = dp_group
        setattr(self, GLOBAL_STATE, True)

    def state_dict(self) -> dict[str, Any]:
        part = self.loader.state_dict()
        if self.dp_group is None:
            parts = [part]
        else:  # every data-parallel rank calls this at the same save
            parts = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(parts, part, group=self.dp_group)
        return self.loader.merge_state_dicts(parts)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


def checkpointed_loader(loader, dp_mesh, *, per_rank: bool):
    """The object the checkpointer gets for `loader` (see the module docstring); `per_rank`
    keeps the loader's own state (replica groups checkpoint their data separately)."""
    if per_rank or not callable(getattr(loader, "merge_state_dicts", None)):
        return loader
    return GlobalLoaderState(loader, None if dp_mesh is None else dp_mesh.get_group())


OPTIONAL = {
    "global_batch_size": None,
    "num_workers": 0,
    "prefetch_factor": None,
    "pin_memory": None,
    "seed": None,
    "text_field": "text",
}
"""Keywords newer than the first data plugins, with the value that asks for nothing (None:
any value may be dropped silently)."""


def plugin_kwargs(build, kwargs: dict[str, Any], plugin: str) -> dict[str, Any]:
    """`kwargs` without the optional keywords `build` (a plugin's `build_dataloader`) does not
    take; dropping one that asks for something (workers) is named in a warning."""
    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    dropped = [
        k
        for k in kwargs
        if k not in params and k in OPTIONAL and OPTIONAL[k] not in (None, kwargs[k])
    ]
    kwargs = {k: v for k, v in kwargs.items() if k in params or k not in OPTIONAL}
    if dropped:
        log.warning(
            "data plugin %s does not take %s; training without %s",
            plugin,
            ", ".join(dropped),
            "them" if len(dropped) > 1 else "it",
        )
    return kwargs
