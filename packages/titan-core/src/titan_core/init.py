"""Initial weights as a function of (seed, parameter name): the same values on every layout.

A model describes how each parameter starts as data, a `ParamInit` per fully qualified name
(its `init_plan()`). The values of one parameter depend only on the run's seed, the
parameter's name and its full shape, never on how it is sharded or which pipeline stage holds
it, nor on the order in which parameters are visited. So one process, FSDP over 512 ranks and
a pipeline stage that holds only layers 40-47 all start from bit-identical weights, and no
rank ever materialises more than its own shards plus one block.

How values are drawn: the parameter is cut along its first dimension into blocks of at most
`BLOCK_ELEMENTS` elements (the cut depends only on the full shape). Block `i` is drawn in
float32 on the parameter's device from a generator seeded with a hash of (seed, key, i), where
`key` is the parameter's name (or the name of the parameter it is tied to). A sharded
parameter (a DTensor with any placements, FSDP over TP included) draws only the blocks that
overlap its shard and keeps the rows and columns it owns.

Values agree bit for bit between layouts on the same device type; CPU and CUDA generators
differ, so a CPU run and a GPU run with the same seed start from different weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Literal

import torch
from torch import nn

BLOCK_ELEMENTS = 1 << 24
"""Elements per drawn block (64 MiB in float32): the most any rank holds beyond its shards."""

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts.

    kind: `normal` (mean, std), `trunc_normal` (mean, std, cut at `a` and `b`, absolute
    values as in `nn.init.trunc_normal_`), `uniform` (between `a` and `b`) or `constant`
    (`value`). `key` names the parameter whose draw this one shares (tied weights); by default
    the parameter's own name.
    """

    kind: Literal["normal", "trunc_normal", "uniform", "constant"]
    std: float = 1.0
    mean: float = 0.0
    a: float = -2.0
    b: float = 2.0
    value: float = 0.0
    key: str | None = None

    @classmethod
    def truncated(cls, std: float, *, sigmas: float = 3.0, key: str | None = None) -> ParamInit:
        """Zero-mean normal with standard deviation `std`, cut at +-`sigmas` standard deviations."""
        return cls("trunc_normal", std=std, a=-sigmas * std, b=sigmas * std, key=key)


def canonical_name(name: str) -> str:
    """A parameter name with the wrappers of activation checkpointing and compile removed, so
    that it matches the name in the unwrapped model (and in its `init_plan`)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def block_seed(seed: int, key: str, block: int) -> int:
    """The generator seed of one block of one parameter (stable across processes and runs)."""
    digest = hashlib.sha256(f"{seed}/{key}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def row_blocks(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) rows of each block of a parameter of this full shape."""
    if not shape:
        return [(0, 1)]
    rest = math.prod(shape[1:]) or 1
    per_block = max(1, BLOCK_ELEMENTS // rest)
    return [(start, min(shape[0], start + per_block)) for start in range(0, shape[0], per_block)]


def draw_block(
    init: ParamInit,
    shape: tuple[int, ...],
    block: int,
    *,
    seed: int,
    key: str,
    device: torch.device | str,
) -> torch.Tensor:
    """Block `block` of a parameter of full shape `shape`, as a float32 tensor on `device`."""
    start, stop = row_blocks(shape)[block]
    out = torch.empty((stop - start, *shape[1:]) if shape else (), device=device)
    if init.kind == "constant":
        return out.fill_(init.value)
    gen = torch.Generator(device=out.device)
    gen.manual_seed(block_seed(seed, key, block))
    if init.kind == "normal":
        return out.normal_(init.mean, init.std, generator=gen)
    if init.kind == "uniform":
        return out.uniform_(init.a, init.b, generator=gen)
    if init.kind == "trunc_normal":
        # Inverse CDF: one uniform draw per element, no rejection loop, so the result and the
        # memory used do not depend on the values drawn (and fake tensors can trace it).
        lo, hi = (_normal_cdf((x - init.mean) / init.std) for x in (init.a, init.b))
        out.uniform_(2 * lo - 1, 2 * hi - 1, generator=gen)
        return out.erfinv_().mul_(init.std * math.sqrt(2.0)).add_(init.mean).clamp_(init.a, init.b)
    raise ValueError(
        f"unknown ParamInit kind {init.kind!r}; known: normal, trunc_normal, uniform, constant"
    )


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@torch.no_grad()
def init_parameter_(param: torch.Tensor, init: ParamInit, *, seed: int, key: str) -> None:
    """Fill `param` in place with its values under (seed, key): a plain tensor gets every
    block; a DTensor gets, on each rank, exactly the entries of its own shard."""
    from torch.distributed.tensor import DTensor

    shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        target = param.data
        for i, (start, stop) in enumerate(row_blocks(shape)):
            values = draw_block(init, shape, i, seed=seed, key=key, device=target.device)
            if shape:
                target[start:stop].copy_(values)
            else:
                target.copy_(values)
        return
    local = param.to_local()
    if local.numel() == 0:
        return
    mesh = param.device_mesh
    # The coordinate is part of the key: a mesh of the same shape on another rank (the dry
    # run simulates several ranks in one process) compares equal but holds other shards.
    plan = _shard_plan(shape, mesh, tuple(param.placements), tuple(mesh.get_coordinate()))
    for block, positions, rows, others in plan:
        values = draw_block(init, shape, block, seed=seed, key=key, device=local.device)
        mine = values.index_select(0, rows.to(values.device))
        for dim, index in others:
            mine = mine.index_select(dim, index.to(values.device))
        local.index_copy_(0, positions.to(local.device), mine.to(local.dtype))


@cache
def _shard_plan(shape: tuple[int, ...], mesh, placements: tuple, coordinate: tuple) -> list:
    """What one rank draws for a DTensor of full `shape`: for each block that overlaps its
    shard, (block, local row positions, rows within the block, [(dim, indices kept)]).

    The global indices a shard holds along each dimension are found by sharding a small index
    tensor with the same placements, so every placement DTensor knows (Shard, FSDP's strided
    shard over TP, uneven splits) is handled by DTensor itself. The index tensors are real even
    inside a fake-tensor dry run: they are small and their values matter.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import distribute_tensor

    if not shape:
        return [(0, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), [])]
    sharders = [1] * len(shape)
    for size, placement in zip(mesh.shape, placements):
        dim = getattr(placement, "dim", None)
        if dim is not None:
            sharders[dim % len(shape)] *= size
    with unset_fake_temporarily():
        indices = []
        for dim, size in enumerate(shape):
            if sharders[dim] == 1:
                indices.append(None)  # whole dimension
                continue
            proxy_shape = [sharders[d] if d != dim else size for d in range(len(shape))]
            view = [1] * len(shape)
            view[dim] = size
            proxy = torch.arange(size).view(view).expand(proxy_shape).contiguous()
            local = distribute_tensor(proxy, mesh, list(placements), src_data_rank=None).to_local()
            if local.numel() == 0:
                return []
            indices.append(local[tuple(slice(None) if d == dim else 0 for d in range(len(shape)))])
        rows = indices[0] if indices[0] is not None else torch.arange(shape[0])
        others = [(d, index) for d, index in enumerate(indices) if d > 0 and index is not None]
        plan = []
        for block, (start, stop) in enumerate(row_blocks(shape)):
            positions = ((rows >= start) & (rows < stop)).nonzero().flatten()
            if positions.numel():  # another rank's rows are never drawn here
                plan.append((block, positions, rows[positions] - start, others))
    return plan


def init_from_plan_(module: nn.Module, plan: Mapping[str, ParamInit], seed: int) -> list[str]:
    """Initialise every parameter of `module` named in `plan` (names as in the unwrapped
    model); a tied parameter is filled once. Buffers the plan names are filled too (state
    saved with the weights, such as a mixture-of-experts layer's expert bias). Returns the
    names of parameters the plan does not cover (the caller decides whether that is an error)."""
    missing = []
    for name, param in module.named_parameters():
        name = canonical_name(name)
        init = plan.get(name)
        if init is None:
            missing.append(name)
            continue
        init_parameter_(param, init, seed=seed, key=init.key or name)
    for name, buffer in module.named_buffers():
        init = plan.get(canonical_name(name))
        if init is not None:
            init_parameter_(buffer, init, seed=seed, key=init.key or canonical_name(name))
    return missing
