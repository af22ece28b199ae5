"""`linear_foreach_sharding`: a foreach op's sharding is propagated with one scan of its
argument specs, not one per tensor, and to the same result (placements and `_StridedShard`
flags), including for FSDP-over-TP parameters whose placements hold a `_StridedShard`."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import _StridedShard

from titan_parallel.foreach_sharding import linear_foreach_sharding
from titan_parallel.memory_estimate import fake_process_group

N = 24  # tensors per foreach op: the old propagation scans N x 2N specs


def _dtensors(mesh, placements, shapes):
    return [
        DTensor.from_local(
            torch.ones(rows // 4, cols), mesh, placements, run_check=False,
            shape=torch.Size((rows, cols)), stride=(cols, 1),
        )
        for rows, cols in shapes
    ]  # fmt: skip


def _foreach_result(scans: list[int], patched: bool) -> list[tuple]:
    """Placements and strided-shard flags of a foreach op's outputs, and the count of scans
    of its argument specs. DTensor caches its decisions across process groups: each run
    gets shapes of its own."""
    original = OpSchema.args_spec

    def counted(self):
        scans[0] += 1
        return original.fget(self)

    with fake_process_group(4), pytest.MonkeyPatch.context() as mp:
        mp.setattr(OpSchema, "args_spec", property(counted))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        placements = [_StridedShard(0, split_factor=2), Shard(0)]  # FSDP over TP
        shapes = [(8 * (1 + i % 3), 4 + i + N * patched) for i in range(N)]  # no cache hits
        a, b = _dtensors(mesh, placements, shapes), _dtensors(mesh, placements, shapes)
        scans[0] = 0
        with linear_foreach_sharding() if patched else contextlib.nullcontext():
            out = torch._foreach_add(a, b)
        return [(o.placements, o._spec.use_strided_shard_as_shard_order) for o in out]


def test_foreach_op_scans_its_specs_once_with_the_same_sharding():
    from torch.distributed.tensor import _sharding_prop

    if not hasattr(_sharding_prop, "_propagate_use_strided_shard_flag"):
        pytest.skip("this torch has no per-strategy _StridedShard fix-up (older torch)")
    torch_scans, linear_scans = [0], [0]
    expected = _foreach_result(torch_scans, patched=False)
    assert _foreach_result(linear_scans, patched=True) == expected
    assert all(any(isinstance(p, _StridedShard) for p in pl) for pl, _ in expected)
    # torch 2.15 scans all 2N specs once per output (N times); here once per op.
    assert linear_scans[0] == 1 and torch_scans[0] >= N, (linear_scans, torch_scans)
