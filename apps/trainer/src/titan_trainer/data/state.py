"""The data loader's place in the checkpoint.

A loader whose state is a position in a global sample order (`merge_state_dicts`, see
`titan_core.StatefulLoader`) is checkpointed as that one global position: at save time the
data-parallel ranks' parts are gathered and merged, every rank holds the same state, and the
checkpointer stores one copy that a job with any data-parallel degree resumes from. Other
loaders keep their per-rank state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from titan_core import GLOBAL_STATE


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
    if per_rank or loader.merge_state_dicts is None:
        return loader
    return GlobalLoaderState(loader, None if dp_mesh is None else dp_mesh.get_group())
