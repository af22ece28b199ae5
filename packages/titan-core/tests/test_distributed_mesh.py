"""Meshes on a real 4-process gloo group: one spawn, many layouts checked inside it."""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp

LAYOUTS = [
    dict(dp_shard=4),
    dict(dp_replicate=2, dp_shard=2),
    dict(dp_shard=2, tp=2),
    dict(dp_shard=2, cp=2),
    dict(dp_replicate=2, cp=2),
    dict(pp=2, tp=2, dp_shard=1),
    dict(dp_replicate=4, dp_shard=1),
    # Expert parallel borrows from dp_shard x cp: its inner ranks.
    dict(dp_shard=4, ep=2),
    dict(dp_shard=2, cp=2, ep=4),
    dict(dp_replicate=2, dp_shard=2, ep=2),
    dict(dp_shard=2, tp=2, ep=2),
]
ROLES = ("dp", "dp_shard_cp", "dp_cp", "fsdp", "tp", "cp", "pp", "dp_replicate", "ep", "ep_fsdp", "ep_tp")  # fmt: skip


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from titan_core import ParallelDims, set_seed

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = []
    for layout in LAYOUTS:
        dims = ParallelDims(world_size=world, **layout)
        dims.build_mesh("cpu")
        sizes = {}
        for role in ROLES:
            mesh = dims.mesh(role)
            sizes[role] = None if mesh is None else mesh.size()
        # The flattened batch mesh must really group the ranks that see different data:
        # an all-reduce over it sums exactly dp_degree ranks.
        dp = dims.mesh("dp")
        if dp is not None:
            t = torch.ones(1)
            dist.all_reduce(t, group=dp.get_group())
            sizes["dp_allreduce"] = int(t.item())
        fsdp = dims.mesh("fsdp")
        sizes["fsdp_ndim"] = None if fsdp is None else fsdp.ndim
        ep = dims.mesh("ep")
        if ep is not None:  # which ranks exchange tokens, and which shard the same experts
            sizes["ep_ranks"] = dist.get_process_group_ranks(ep.get_group())
            ep_fsdp = dims.mesh("ep_fsdp")
            sizes["ep_fsdp_ranks"] = sorted(
                r for d in range(ep_fsdp.ndim) for r in dist.get_process_group_ranks(ep_fsdp.get_group(d))
            )  # fmt: skip
        # Seeds: equal across everything but pp.
        seed = set_seed(1234, dims.world_mesh, vary_over=("pp",))
        # all_gather of tensors, not objects: object collectives need numpy, which torch alone lacks.
        coord = dims.world_mesh.get_coordinate()
        mine = torch.tensor([*coord, *([0] * (5 - len(coord))), seed], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        gathered = [(t[: len(coord)].tolist(), int(t[-1])) for t in gathered]
        sizes["seeds"] = gathered
        results.append(sizes)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    mp.spawn(_worker, args=(4, str(tmp / "init"), str(tmp)), nprocs=4, join=True)
    return [json.load(open(tmp / f"rank{r}.json")) for r in range(4)]


EXPECTED = {
    0: dict(
        dp=4,
        dp_shard_cp=4,
        dp_cp=4,
        fsdp=4,
        tp=None,
        cp=None,
        pp=None,
        dp_replicate=None,
        fsdp_ndim=1,
    ),
    1: dict(
        dp=4, dp_shard_cp=2, dp_cp=4, fsdp=4, tp=None, cp=None, pp=None, dp_replicate=2, fsdp_ndim=2
    ),
    2: dict(
        dp=2, dp_shard_cp=2, dp_cp=2, fsdp=2, tp=2, cp=None, pp=None, dp_replicate=None, fsdp_ndim=1
    ),
    3: dict(
        dp=2, dp_shard_cp=4, dp_cp=4, fsdp=4, tp=None, cp=2, pp=None, dp_replicate=None, fsdp_ndim=1
    ),
    4: dict(
        dp=2, dp_shard_cp=2, dp_cp=4, fsdp=4, tp=None, cp=2, pp=None, dp_replicate=2, fsdp_ndim=2
    ),
    5: dict(
        dp=None,
        dp_shard_cp=None,
        dp_cp=None,
        fsdp=None,
        tp=2,
        cp=None,
        pp=2,
        dp_replicate=None,
        fsdp_ndim=None,
    ),
    6: dict(
        dp=4,
        dp_shard_cp=None,
        dp_cp=4,
        fsdp=4,
        tp=None,
        cp=None,
        pp=None,
        dp_replicate=4,
        fsdp_ndim=1,
    ),
}


# Expert layouts: sizes, then (for rank 0 and rank 3) the ranks of their ep and ep_fsdp groups.
EXPECTED |= {
    7: dict(dp=4, dp_shard_cp=4, fsdp=4, ep=2, ep_fsdp=2, ep_tp=None),
    8: dict(dp=2, dp_shard_cp=4, fsdp=4, ep=4, ep_fsdp=1, ep_tp=None),
    9: dict(dp=4, dp_shard_cp=2, fsdp=4, ep=2, ep_fsdp=2, ep_tp=None),
    10: dict(dp=2, dp_shard_cp=2, fsdp=2, tp=2, ep=2, ep_fsdp=1, ep_tp=4),
}
EP_GROUPS = {  # layout -> {rank: (ep ranks, ep_fsdp ranks)}
    7: {0: ([0, 1], [0, 2]), 3: ([2, 3], [1, 3])},
    8: {0: ([0, 1, 2, 3], [0]), 3: ([0, 1, 2, 3], [3])},
    9: {0: ([0, 1], [0, 0, 2]), 3: ([2, 3], [1, 3, 3])},
    10: {0: ([0, 2], [0]), 3: ([1, 3], [3])},
}


@pytest.mark.parametrize("index", list(EP_GROUPS), ids=[str(LAYOUTS[i]) for i in EP_GROUPS])
def test_expert_parallel_borrows_the_inner_data_parallel_ranks(mesh_results, index):
    for rank, (ep, ep_fsdp) in EP_GROUPS[index].items():
        got = mesh_results[rank][index]
        assert (got["ep_ranks"], got["ep_fsdp_ranks"]) == (ep, ep_fsdp), rank


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[str(layout) for layout in LAYOUTS])
def test_role_meshes_have_the_right_sizes(mesh_results, index):
    for rank in range(4):
        got = mesh_results[rank][index]
        for role, size in EXPECTED[index].items():
            assert got[role] == size, (rank, role)
        if EXPECTED[index]["dp"] is not None:
            assert got["dp_allreduce"] == EXPECTED[index]["dp"]


def test_seeds_differ_across_pipeline_stages_only(mesh_results):
    pp_layout = LAYOUTS.index(dict(pp=2, tp=2, dp_shard=1))
    seeds = mesh_results[0][pp_layout]["seeds"]
    by_stage = {}
    for coord, seed in seeds:
        by_stage.setdefault(coord[0], set()).add(seed)
    assert all(len(s) == 1 for s in by_stage.values())  # tp ranks of a stage share a seed
    assert len({next(iter(s)) for s in by_stage.values()}) == 2  # stages differ
    dp_layout = LAYOUTS.index(dict(dp_shard=4))
    assert len({seed for _, seed in mesh_results[0][dp_layout]["seeds"]}) == 1


def test_flight_recorder_settings_do_not_outlive_the_job(tmp_path):
    # In a fresh process: a job's TORCH_FR_* settings are undone when it ends, so that a later
    # job (or a process started afterwards) does not take them for the user's own; a value
    # the user set stays; the trace folder is the caller's to create.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import os
        from titan_core import init_distributed
        from titan_core.distributed import destroy_distributed
        init_distributed("cpu", trace_buf_size=7, trace_dir={str(tmp_path / "traces")!r})
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "7"
        destroy_distributed()
        assert "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
        os.environ["TORCH_FR_BUFFER_SIZE"] = "9"
        init_distributed("cpu", trace_buf_size=7, trace_dir={str(tmp_path / "traces")!r})
        destroy_distributed()
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "9"
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert not (tmp_path / "traces").exists()


def test_a_torchrun_restart_joins_its_own_attempt_not_the_failed_one(tmp_path):
    # torchrun --max-restarts keeps one store for every attempt of a job. Attempt 0: both ranks
    # join and all-reduce, then rank 1 exits with an error and torchrun restarts both. In
    # attempt 1 rank 1 joins 3 s late: had rank 0 read the failed attempt's address of rank 1
    # (still in the store without the per-attempt keys), it would wait on a dead peer until the
    # 30 s timeout; it must wait for the new rank 1 instead and finish.
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "restart_job.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            import torch
            import torch.distributed as dist
            from titan_core import init_distributed
            from titan_core.distributed import destroy_distributed
            attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
            if attempt == 1 and rank == 1:
                time.sleep(3)
            start = time.monotonic()
            info = init_distributed("cpu", timeout_seconds=30)
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
            if attempt == 0 and rank == 1:
                os._exit(1)
            if attempt == 0:
                dist.all_reduce(t)  # rank 1 has gone: this fails, torchrun restarts the job
            print(f"attempt {attempt} rank {rank} joined in {time.monotonic() - start:.1f} s")
            destroy_distributed()
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--max-restarts", "1", str(script)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "attempt 1 rank 0 joined" in done.stdout and "attempt 1 rank 1 joined" in done.stdout
