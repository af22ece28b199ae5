"""Seeding per rank and per mesh dimension."""

from __future__ import annotations

import random

import torch
from torch.distributed.device_mesh import DeviceMesh


def set_seed(
    seed: int,
    mesh: DeviceMesh | None = None,
    vary_over: tuple[str, ...] = ("pp",),
    deterministic: bool = False,
) -> int:
    """Seed python, torch (CPU and CUDA) from `seed`, offset by this rank's coordinate along
    each mesh dimension named in `vary_over`.

    Ranks that hold copies or shards of the same tensors (data parallel, TP) must draw the same
    numbers, so they share a seed; ranks that hold different modules (pipeline stages) or need
    different randomness (dropout across dp, say) are named in `vary_over`. Returns the seed used.
    """
    offset = 0
    if mesh is not None and mesh.mesh_dim_names:
        stride = 1
        for name in reversed(mesh.mesh_dim_names):
            size = mesh.size(mesh.mesh_dim_names.index(name))
            if name in vary_over:
                offset += mesh.get_local_rank(name) * stride
            stride *= size
    final = (seed + offset) % (2**63 - 1)
    random.seed(final)
    torch.manual_seed(final)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return final
