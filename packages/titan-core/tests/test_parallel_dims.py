from __future__ import annotations

import pytest

from titan_core import ConfigError, ParallelDims


def test_dp_shard_minus_one_fills_the_rest():
    dims = ParallelDims(world_size=16, dp_replicate=2, tp=2, pp=2)
    assert dims.dp_shard == 2
    assert dims.dp_degree == 4 and dims.degree("fsdp") == 4 and dims.degree("dp_cp") == 4
    assert dims.fsdp_enabled and dims.tp_enabled and dims.pp_enabled and not dims.cp_enabled


def test_seq_len_divisor_accounts_for_tp_and_cp_load_balancing():
    assert ParallelDims(world_size=8, tp=2, cp=2).seq_len_divisor == 8
    assert ParallelDims(world_size=2, tp=2).seq_len_divisor == 2
    assert ParallelDims(world_size=1).seq_len_divisor == 1


def test_degrees_that_do_not_multiply_to_world_size():
    with pytest.raises(ConfigError) as info:
        ParallelDims(world_size=4, dp_shard=2, tp=2, pp=2)
    assert str(info.value) == (
        "titan: config error: parallelism degrees multiply to 8 (data_parallel_shard 2 x tensor_parallel 2 x pipeline_parallel 2)\n"
        "       but the job has 4 processes; use -1 for data_parallel_shard_degree to fill the rest"
    )


def test_degrees_that_do_not_divide_world_size():
    with pytest.raises(ConfigError) as info:
        ParallelDims(world_size=6, tp=4)
    assert str(info.value) == (
        "titan: config error: the job has 6 processes, which tensor_parallel 4 = 4 does not divide\n"
        "       choose degrees whose product divides the number of processes"
    )


@pytest.mark.parametrize(
    "key,kwargs", [("tensor_parallel_degree", {"tp": 0}), ("pipeline_parallel_degree", {"pp": -2})]
)
def test_negative_or_zero_degree(key, kwargs):
    with pytest.raises(ConfigError) as info:
        ParallelDims(world_size=1, **kwargs)
    value = next(iter(kwargs.values()))
    assert str(info.value) == (
        f"titan: config error: [parallelism] {key} = {value} is not valid\n       use a degree of 1 or more"
    )


def test_dp_shard_zero_is_rejected_with_the_fill_hint():
    with pytest.raises(ConfigError) as info:
        ParallelDims(world_size=2, dp_shard=0)
    assert "or -1 to use every process the other degrees leave" in str(info.value)


def test_single_process_mesh_has_no_parallel_roles(single_process_group):
    dims = ParallelDims(world_size=1)
    mesh = dims.build_mesh("cpu")
    assert mesh.size() == 1
    for name in ("dp", "dp_shard_cp", "dp_cp", "fsdp", "tp", "cp", "pp"):
        assert dims.mesh(name) is None
