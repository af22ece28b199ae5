"""Cases run inside one gloo process group per world size (started once by test_distributed.py).

Each case raises on failure; `main` records "ok" or the traceback per case and rank, so that one
failing case does not hide the others.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_toy import assert_same, build_run, full_model, full_optimizer, train

from titan_ckpt import Checkpoint, CheckpointManager, CheckpointSaveError, read_safetensors
from titan_ckpt.cli import main as cli
from titan_ckpt.layout import read_commit

N = 3


def _reference(work: Path) -> dict:
    return torch.load(work / "reference.pt", weights_only=True)


def _exact_resume(work: Path, layout: str, async_mode: str, executor: str = "thread") -> None:
    """2N steps in one go == N steps, stop, resume for N: losses and parameters bitwise."""
    folder = work / f"resume-{layout}-{async_mode}-{executor}"
    a = build_run(layout)
    losses_a = train(a, 2 * N)
    params_a = full_model(a.model)

    cfg = Checkpoint(enable=True, interval=N, async_mode=async_mode, async_executor=executor)
    b = build_run(layout)
    manager = CheckpointManager(
        cfg, b.states(), folder, dp_rank=b.data.dp_rank, dp_world_size=_dp_world(layout)
    )
    # One step past the save: it runs while an async save may still be copying, and is then lost.
    losses_b = train(b, N + 1, manager)[:N]
    manager.close()

    c = build_run(layout, seed=123)  # different initial weights: the load must overwrite them
    manager = CheckpointManager(
        cfg, c.states(), folder, dp_rank=c.data.dp_rank, dp_world_size=_dp_world(layout)
    )
    assert manager.load() == N
    assert c.state.step == N and c.data.position == N
    losses_b += train(c, N, manager, last_step=2 * N)
    manager.close()
    # Same layout, same deterministic gloo reductions: no tolerance, bitwise equality.
    assert losses_a == losses_b, (losses_a, losses_b)
    assert_same(params_a, full_model(c.model), f"{layout} parameters after resume")


def _dp_world(layout: str) -> int:
    world = dist.get_world_size()
    return world // 2 if layout == "fsdp_tp" else world


def _load_and_compare(work: Path, layout: str, source: str, dest: str) -> None:
    """Load checkpoint `source` under `layout`: model and optimizer equal the reference; then save
    it under this layout to `dest` for the next link of the chain."""
    ref = _reference(work)
    run = build_run(layout, seed=99)
    cfg = Checkpoint(
        enable=True, interval=2, initial_load_path=str(work / source), initial_load_model_only=False
    )
    manager = CheckpointManager(
        cfg, run.states(), work / dest, dp_rank=run.data.dp_rank, dp_world_size=_dp_world(layout)
    )
    assert manager.load() == 0  # from initial_load_path: a new run in a new folder
    # Parameters and optimizer state are copied, never recomputed: bitwise equality.
    assert_same(ref["model"], full_model(run.model), f"model {source} -> {layout}")
    assert_same(
        ref["optimizer"],
        full_optimizer(run.model, run.optimizer),
        f"optimizer {source} -> {layout}",
    )
    assert run.state.step == ref["step"]
    assert run.scheduler.last_epoch == ref["step"]
    # The data-parallel size changed (1 -> n): loaders are not restored and say so in the log.
    if _dp_world(layout) != read_commit(work / source)["dp_world_size"]:
        assert run.data.position == 0
    manager.save(ref["step"])
    manager.close()
    if dist.get_rank() == 0:
        assert (work / dest / f"step-{ref['step']}" / "titan_commit.json").is_file()


def case_exact_resume_fsdp_async(work: Path) -> None:
    _exact_resume(work, "fsdp", "async")


def case_exact_resume_fsdp_async_process(work: Path) -> None:
    _exact_resume(work, "fsdp", "async", executor="process")


def case_exact_resume_hsdp(work: Path) -> None:
    _exact_resume(work, "hsdp", "disabled")


def case_reshard_1_to_fsdp2(work: Path) -> None:
    _load_and_compare(work, "fsdp", "ckpt1/step-2", "fsdp2")


def case_reshard_fsdp2_to_fsdp4(work: Path) -> None:
    _load_and_compare(work, "fsdp", "fsdp2/step-2", "fsdp4")


def case_reshard_fsdp4_to_fsdp2_tp2(work: Path) -> None:
    _load_and_compare(work, "fsdp_tp", "fsdp4/step-2", "fsdp_tp")


def case_reshard_fsdp2_tp2_to_fsdp4(work: Path) -> None:
    _load_and_compare(work, "fsdp", "fsdp_tp/step-2", "fsdp4_again")


def case_seed_checkpoint_loads_in_fsdp2(work: Path) -> None:
    run = build_run("fsdp", seed=42)
    manager = CheckpointManager(
        Checkpoint(enable=True), run.states(), work / "seed", dp_world_size=2
    )
    assert manager.load() == 0
    manager.close()
    seed_weights = torch.load(work / "seed_weights.pt", weights_only=True)
    assert_same(seed_weights, full_model(run.model), "seed checkpoint weights under FSDP 2")


def case_corrupt_file_checked_by_rank_1_makes_every_rank_fall_back(work: Path) -> None:
    """The ranks share the checksum work: rank 1 checks `__1_0.distcp`, rank 0 learns the
    verdict from it, and both load step 2 instead of the corrupt step 4."""
    folder = work / "corrupt-fsdp2"
    run = build_run("fsdp")
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), run.states(), folder)
    train(run, 2, manager)
    at_2 = full_model(run.model)
    train(run, 2, manager)
    manager.close()
    if dist.get_rank() == 0:
        data = folder / "step-4" / "__1_0.distcp"
        data.write_bytes(b"\0" * data.stat().st_size)
    dist.barrier()
    fresh = build_run("fsdp", seed=5)
    assert CheckpointManager(Checkpoint(enable=True), fresh.states(), folder).load() == 2
    assert_same(at_2, full_model(fresh.model), "model after every rank fell back to step 2")


def case_nan_in_one_ranks_shard_refuses_the_save_on_every_rank(work: Path) -> None:
    run = build_run("fsdp")
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=2), run.states(), work / "nan-fsdp2"
    )
    train(run, 2, manager)
    if dist.get_rank() == 1:
        with torch.no_grad():
            run.model.out.weight.to_local()[0, 0] = float("nan")
    try:
        manager.save(4)
    except CheckpointSaveError as e:
        assert str(e).startswith("checkpoint step 4 not saved: model.out.weight hold NaN"), e
    else:
        raise AssertionError("the save with a NaN on rank 1 went through")
    manager.close()
    assert not (work / "nan-fsdp2" / "step-4").exists()


HF_SPEC = "ckpt_toy_hf:SLICED_TOY_SPEC"


def case_hf_conversions_on_2_ranks_write_what_one_process_writes(work: Path) -> None:
    """`titan-ckpt convert` with the process group up (as under torchrun): each rank holds
    half the rows of every tensor. dcp-to-hf writes, in several files, the tensors the
    one-process export wrote (bitwise); hf-to-dcp writes a checkpoint both ranks wrote that
    loads as the model that was saved."""
    hf = ["--model", HF_SPEC, "--flavor", "tiny"]
    step, hf_one = work / "ckpt1" / "step-2", work / "hf_one"
    out = work / "hf_two"
    assert cli(["convert", "dcp-to-hf", str(step), str(out), *hf, "--max-shard-gb", "1e-5"]) == 0
    assert cli(["convert", "hf-to-dcp", str(hf_one), str(work / "dcp_two"), *hf]) == 0

    one, two = read_safetensors(hf_one, progress=False), read_safetensors(out, progress=False)
    assert one.keys() == two.keys(), (sorted(one), sorted(two))
    assert all(torch.equal(one[k], two[k]) for k in one), "the 2 ranks' export differs"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, index  # files both ranks wrote into
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (hf_one / "config.json").read_text()
    )
    assert read_commit(work / "dcp_two")["world_size"] == 2
    fresh = build_run("fsdp", seed=9)
    cfg = Checkpoint(enable=True, initial_load_path=str(work / "dcp_two"))
    assert CheckpointManager(cfg, fresh.states(), work / "hf-run", dp_world_size=2).load() == 0
    assert_same(_reference(work)["model"], full_model(fresh.model), "HF -> DCP on 2 ranks")


def main(rank: int, world: int, init_file: str, work: str, cases: list[str]) -> None:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=90),
    )
    results = {}
    start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        try:
            globals()[f"case_{case}"](Path(work))
            results[case] = "ok"
        except Exception:
            results[case] = traceback.format_exc()
        dist.barrier()
        results[f"{case}.seconds"] = round(time.perf_counter() - t0, 2)
    results["total_seconds"] = round(time.perf_counter() - start, 2)
    dist.destroy_process_group()
    Path(work, f"results-{world}-{rank}.json").write_text(json.dumps(results))
