"""ParallelDims: how the job's processes are split between the kinds of parallelism, and the
device meshes that carry each split.

The world mesh is laid out (pp, dp_replicate, dp_shard, cp, tp), outermost first, so that the
fastest-communicating dimension (tp) holds neighbouring ranks. Only dimensions with a degree
above 1 become mesh dimensions. Roles that span several dimensions are flattened views:

    "dp"          dp_replicate x dp_shard        ranks that see different data (batching)
    "dp_shard_cp" dp_shard x cp                  FSDP's sharding group (CP folds into it)
    "dp_cp"       dp_replicate x dp_shard x cp   ranks over which the loss is averaged
    "fsdp"        (dp_replicate,) dp_shard_cp    the 1-D or 2-D (HSDP) mesh fully_shard takes

Expert parallel (`ep`) is not a dimension of its own: it borrows its ranks from dp_shard x cp,
whose flattened mesh is split into (ep_shard, ep), ep the inner (closest) ranks:

    "ep"          ep                             ranks that hold different experts and
                                                 exchange tokens (all-to-all)
    "ep_fsdp"     (dp_replicate,) ep_shard       the mesh FSDP shards expert weights over:
                                                 dp_shard_cp / ep ranks (possibly 1), HSDP
                                                 with dp_replicate
    "ep_tp"       ep x tp                        the 2-D mesh of expert weights split by both
                                                 expert and tensor parallel

Meshes are created on first use; `mesh(name)` returns None for a role whose degree is 1
(`ep_fsdp` exists whenever ep > 1, `ep_tp` whenever ep > 1 and tp > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_core.config import ConfigError

_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The config keys users set, for error messages (torchtitan's [parallelism] names).
_KEYS = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "pp": "pipeline_parallel_degree",
    "ep": "expert_parallel_degree",
}
_EXPERT = ("ep", "ep_fsdp", "ep_tp")
_FLAT = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    """Degrees of each parallelism. `dp_shard=-1` takes whatever the others leave."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _meshes: dict[str, DeviceMesh | None] = field(default_factory=dict, init=False, repr=False)
    _device_type: str = field(default="cpu", init=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        for name in ("dp_replicate", "cp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if value < 1:
                problems.append(
                    f"[parallelism] {_KEYS[name]} = {value} is not valid\nuse a degree of 1 or more"
                )
        if self.dp_shard == 0 or self.dp_shard < -1:
            problems.append(
                f"[parallelism] {_KEYS['dp_shard']} = {self.dp_shard} is not valid\n"
                "use a degree of 1 or more, or -1 to use every process the other degrees leave"
            )
        if problems:
            raise ConfigError(problems)
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"the job has {self.world_size} processes, which {self._product_text(skip_shard=True)}"
                    f" = {others} does not divide\nchoose degrees whose product divides the number of processes"
                )
            self.dp_shard = self.world_size // others
        total = others * self.dp_shard
        if total != self.world_size:
            raise ConfigError(
                f"parallelism degrees multiply to {total} ({self._product_text()})\n"
                f"but the job has {self.world_size} processes; use -1 for "
                f"{_KEYS['dp_shard']} to fill the rest"
            )
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ConfigError(
                f"[parallelism] {_KEYS['ep']} = {self.ep} must divide data_parallel_shard x context_parallel"
                f" = {self.dp_shard * self.cp}\nexpert parallel borrows its ranks from those dimensions"
            )

    def _product_text(self, skip_shard: bool = False) -> str:
        parts = [
            f"{_KEYS[n].removesuffix('_degree')} {getattr(self, n)}"
            for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
            if getattr(self, n) != 1 and not (skip_shard and n == "dp_shard")
        ]
        return " x ".join(parts) or "every degree 1"

    # ------------------------------------------------------------------ enabled flags
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_degree(self) -> int:
        """How many different batches are processed per step (the loader's world size)."""
        return self.dp_replicate * self.dp_shard

    @property
    def seq_len_divisor(self) -> int:
        """seq_len must divide by this: TP's sequence parallel splits it by tp, and CP's
        load-balanced sharding into 2 x cp chunks."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    def degree(self, name: str) -> int:
        """The number of ranks in a role's mesh (1 for a role that is off)."""
        if name in _FLAT:
            return math.prod(getattr(self, d) for d in _FLAT[name])
        if name == "fsdp":
            return self.dp_replicate * self.dp_shard * self.cp
        if name == "ep_fsdp":
            return self.dp_replicate * self.dp_shard * self.cp // self.ep
        if name == "ep_tp":
            return self.ep * self.tp
        return getattr(self, name)

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh (needs an initialised default process group)."""
        self._device_type = device_type
        dims = [(n, getattr(self, n)) for n in _ORDER if getattr(self, n) > 1]
        if not dims:  # a single process still gets a mesh so callers need no special case
            dims = [("dp_shard", 1)]
        self._world_mesh = init_device_mesh(
            device_type, tuple(d for _, d in dims), mesh_dim_names=tuple(n for n, _ in dims)
        )
        self._meshes.clear()
        return self._world_mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._world_mesh is None:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) first")
        return self._world_mesh

    def mesh(self, name: str) -> DeviceMesh | None:
        """The mesh for one role (see the module docstring); None when its degree is 1."""
        if name not in self._meshes:
            self._meshes[name] = self._make_mesh(name)
        return self._meshes[name]

    def _make_mesh(self, name: str) -> DeviceMesh | None:
        world = self.world_mesh
        present = set(world.mesh_dim_names or ())
        if name in _EXPERT:
            return self._expert_mesh(name) if self.ep > 1 else None
        if self.degree(name) == 1:
            return None
        if name == "fsdp":
            shard = self.mesh("dp_shard_cp")
            if not self.dp_replicate_enabled:
                return shard
            if shard is None:
                return self.mesh("dp_replicate")
            return self._flatten_pair("dp_replicate", "dp_shard_cp")
        if name in _FLAT:
            parts = [d for d in _FLAT[name] if d in present]
            if not parts:
                return None
            if len(parts) == 1:
                return world[parts[0]]
            return world[tuple(parts)]._flatten(name)
        if name not in _ORDER:
            known = ", ".join((*_ORDER, *_FLAT, "fsdp", *_EXPERT))
            raise KeyError(f"unknown mesh {name!r}; known: {known}")
        return world[name] if name in present else None

    def _flatten_pair(self, outer: str, inner: str) -> DeviceMesh:
        # HSDP wants a 2-D mesh (replicate, shard). The shard part is either a plain mesh
        # dimension or a flattened dp_shard x cp, which must exist before it can be indexed.
        present = set(self.world_mesh.mesh_dim_names or ())
        parts = [d for d in _FLAT[inner] if d in present]
        if len(parts) > 1:
            self.mesh(inner)
            parts = [inner]
        return self.world_mesh[(outer, *parts)]

    def _expert_mesh(self, name: str) -> DeviceMesh | None:
        # dp_shard x cp (one mesh, flattened when both are on) split into (ep_shard, ep):
        # views of the world mesh's ranks, so FSDP and DTensor can combine them with the others.
        if name == "ep_tp":
            if self.tp == 1:
                return None
            # A mesh whose dimensions come from two views of the world mesh: torch has no public
            # call for that, and FSDP itself builds its meshes of DTensor parameters this way.
            return DeviceMesh._concatenate([self.mesh("ep"), self.world_mesh["tp"]])
        if "_ep_split" not in self._meshes:
            shard = self.dp_shard * self.cp // self.ep
            self._meshes["_ep_split"] = self.mesh("dp_shard_cp")._unflatten(
                0, (shard, self.ep), ("ep_shard", "ep")
            )
        split = self._meshes["_ep_split"]
        if name == "ep":
            return split["ep"]
        if not self.dp_replicate_enabled:
            return split["ep_shard"]
        return DeviceMesh._concatenate([self.world_mesh["dp_replicate"], split["ep_shard"]])


def dp_coordinates(dims: ParallelDims) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their number), read from the built
    `dims.mesh("dp")`: what keys a data loader's share and its checkpointed state. (0, 1)
    without data parallelism. The one place a Titan package reads them."""
    mesh = dims.mesh("dp")
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())
