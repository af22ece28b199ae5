"""Sums over sharded parameters that equal the sums one process computes on the full tensors.

An optimizer that looks at more than one element at a time (a per-row norm, a per-row mean, a
mean over the whole model) sees only its local shard of a DTensor. Which ranks hold the rest
of a row depends on the placements: under FSDP (`Shard(0)` on the data-parallel dimension) a
rank holds whole rows, so a per-row sum is already complete; a row-wise tensor-parallel weight
(`Shard(1)` on the TP dimension) splits every row over the TP ranks, whose partial sums must
be added; a `Replicate` dimension holds copies, which must not be added. `row_sums_groups` and
`total_sums_groups` name the process groups to add over, and `reduce_sums` adds many partial
sums with one all-reduce per distinct set of groups.

Plain tensors (one process, DDP, a pipeline stage's own parameters) are whole: no groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

Groups = tuple[dist.ProcessGroup, ...]


def _groups(t: torch.Tensor, rows: bool) -> Groups:
    if not isinstance(t, DTensor):
        return ()
    mesh, found = t.device_mesh, []
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(
                f"a parameter has a Partial placement on mesh dimension {mesh_dim}; "
                "optimizer statistics need parameters that are sharded or replicated"
            )
        # Shard, and _StridedShard (FSDP over a TP-sharded dim 0), which torch no longer
        # counts as a Shard: both have the tensor dimension they split.
        if getattr(placement, "dim", None) is None or mesh.size(mesh_dim) == 1:
            continue
        dim = placement.dim % t.ndim
        if not rows or dim != 0:
            found.append(mesh.get_group(mesh_dim))
    return tuple(found)


def row_sums_groups(t: torch.Tensor) -> Groups:
    """Groups whose ranks hold other parts of the same rows of `t` (a row being a slice along
    dim 0): every mesh dimension that shards a dimension other than 0."""
    return _groups(t, rows=True) if t.ndim > 1 else _groups(t, rows=False)


def total_sums_groups(t: torch.Tensor) -> Groups:
    """Groups whose ranks hold the other parts of `t`: every mesh dimension that shards it."""
    return _groups(t, rows=False)


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (the tensor itself when it is not a DTensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def reduce_sums(partials: Sequence[torch.Tensor], groups: Sequence[Groups]) -> list[torch.Tensor]:
    """Add each partial sum over its groups (in place; also returned). Partials with the same
    groups travel in one all-reduce per group; every rank of a group must pass the same
    sequence of shapes for that group, which holds when the ranks hold the same parameters'
    shards (as the ranks of a data- or tensor-parallel group do)."""
    buckets: dict[tuple[str, ...], tuple[Groups, list[int]]] = {}
    for i, g in enumerate(groups):
        if g:
            buckets.setdefault(tuple(x.group_name for x in g), (g, []))[1].append(i)
    for key, idx in buckets.values():
        flat = torch.cat([partials[i].reshape(-1) for i in idx])
        for group in key:
            dist.all_reduce(flat, group=group)
        for i, chunk in zip(idx, flat.split([partials[i].numel() for i in idx])):
            partials[i].copy_(chunk.view_as(partials[i]))
    return list(partials)
