"""DTensor's sharding propagation for foreach and fused ops in linear time.

A foreach or fused op (the optimizer's `_fused_adamw_` over every parameter, gradients and
moments) gets one sharding strategy per tensor. torch 2.15's propagation fixes up each of those
strategies' `_StridedShard` flag by scanning every argument spec of the op, so one optimizer step
of a model with N parameters costs O(N^2): for Llama 3 70B's 723 parameter shards, about 2.6
million scans of 3,615 specs, a fifth of its dry run. The scan only looks at the specs that
hold a `_StridedShard`; this computes that short list once per op and hands each strategy's
fix-up the same answer (`linear_foreach_sharding`). Where torch has no such fix-up (older
torch), there is nothing to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class _StridedSpecsOf:
    """What the fix-up reads of an op schema: its argument specs, here only those holding a
    `_StridedShard` (the fix-up skips every other one)."""

    args_spec: tuple


@contextlib.contextmanager
def linear_foreach_sharding() -> Iterator[None]:
    """Within this block, DTensor's per-strategy `_StridedShard` fix-up scans the op's
    argument specs once per op instead of once per tensor of a foreach op (same result)."""
    from torch.distributed.tensor import _sharding_prop

    original = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if original is None:  # older torch: no per-strategy scan
        yield
        return
    from torch.distributed.tensor.placement_types import _StridedShard

    last: list = [None, None]  # the op schema last seen, its strided specs

    def fix_up(op_strategy, op_schema) -> None:
        if last[0] is not op_schema:
            strided = tuple(
                spec
                for spec in op_schema.args_spec
                if any(isinstance(p, _StridedShard) for p in spec.placements)
            )
            last[:] = [op_schema, _StridedSpecsOf(strided)]
        original(op_strategy, last[1])

    _sharding_prop._propagate_use_strided_shard_flag = fix_up
    try:
        yield
    finally:
        _sharding_prop._propagate_use_strided_shard_flag = original
