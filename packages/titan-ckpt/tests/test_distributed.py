"""Exact resume, resharding and seed checkpoints across real gloo process groups on CPU.

One process group per world size runs every case (see dist_worker.py); the checkpoints travel
along a chain 1 rank -> FSDP 2 -> FSDP 4 -> FSDP 2 x TP 2 -> FSDP 4 -> 1 rank, each link
compared bitwise with the state the single process saved.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import dist_worker
import pytest
import torch
import torch.multiprocessing as mp
from ckpt_toy import assert_same, build_run, full_model, full_optimizer, train

from titan_ckpt import Checkpoint, CheckpointManager
from titan_ckpt.cli import main as cli

WORLD_2 = [
    "exact_resume_fsdp_async",
    "exact_resume_fsdp_async_process",
    "reshard_1_to_fsdp2",
    "seed_checkpoint_loads_in_fsdp2",
    "corrupt_file_checked_by_rank_1_makes_every_rank_fall_back",
    "nan_in_one_ranks_shard_refuses_the_save_on_every_rank",
    "hf_conversions_on_2_ranks_write_what_one_process_writes",
]
WORLD_4 = [
    "exact_resume_hsdp",
    "reshard_fsdp2_to_fsdp4",
    "reshard_fsdp4_to_fsdp2_tp2",
    "reshard_fsdp2_tp2_to_fsdp4",
]


def _write_sources(work: Path) -> None:
    """In this process: a 2-step checkpoint with its reference state, and a seed checkpoint."""
    run = build_run("single")
    manager = CheckpointManager(Checkpoint(enable=True, interval=2), run.states(), work / "ckpt1")
    train(run, 2, manager)
    manager.close()
    reference = {
        "model": full_model(run.model),
        "optimizer": full_optimizer(run.model, run.optimizer),
        "step": run.state.step,
    }
    torch.save(reference, work / "reference.pt")

    seed_run = build_run("single", seed=3)
    seed = CheckpointManager(
        Checkpoint(create_seed_checkpoint=True), seed_run.states(), work / "seed"
    )
    seed.save(0, last_step=True)
    seed.close()
    torch.save(full_model(seed_run.model), work / "seed_weights.pt")

    # The one-process Hugging Face export of step 2, which the 2 ranks' conversions must match.
    hf = ["--model", dist_worker.HF_SPEC, "--flavor", "tiny"]
    assert cli(["convert", "dcp-to-hf", str(work / "ckpt1" / "step-2"), str(work / "hf_one"), *hf]) == 0  # fmt: skip


def _spawn(world: int, work: Path, cases: list[str]) -> dict[str, list[str]]:
    # forkserver: one clean server process imports torch once and forks the ranks, so the ranks
    # neither pay for their own torch import nor inherit this process's threads.
    mp.set_forkserver_preload(
        [
            "torch.distributed.fsdp",
            "torch.distributed.tensor.parallel",
            "titan_ckpt",
            "ckpt_toy",
            "dist_worker",
        ]
    )
    init_file = work / f"init-{world}"
    mp.start_processes(
        dist_worker.main,
        args=(world, str(init_file), str(work), cases),
        nprocs=world,
        start_method="forkserver",
    )
    per_rank = [json.loads((work / f"results-{world}-{r}.json").read_text()) for r in range(world)]
    return {case: [r[case] for r in per_rank] for case in cases}


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _write_sources(work)
        out = {**_spawn(2, work, WORLD_2), **_spawn(4, work, WORLD_4)}
        out["work"] = work
        yield out


def _check(results, case: str) -> None:
    failures = [f"rank {r}:\n{text}" for r, text in enumerate(results[case]) if text != "ok"]
    assert not failures, "\n".join(failures)


def test_exact_resume_fsdp2_with_async_saves_is_bitwise_identical(results):
    _check(results, "exact_resume_fsdp_async")


def test_exact_resume_fsdp2_with_async_saves_in_a_background_process(results):
    _check(results, "exact_resume_fsdp_async_process")


def test_exact_resume_hsdp_2x2_is_bitwise_identical(results):
    _check(results, "exact_resume_hsdp")


@pytest.mark.parametrize(
    "case",
    [
        "reshard_1_to_fsdp2",
        "reshard_fsdp2_to_fsdp4",
        "reshard_fsdp4_to_fsdp2_tp2",
        "reshard_fsdp2_tp2_to_fsdp4",
    ],
)
def test_reshard_keeps_parameters_and_optimizer_state(results, case):
    _check(results, case)


def test_reshard_fsdp2_tp2_back_to_one_process(results):
    work = results["work"]
    ref = torch.load(work / "reference.pt", weights_only=True)
    run = build_run("single", seed=77)
    cfg = Checkpoint(
        enable=True, initial_load_path=str(work / "fsdp_tp/step-2"), initial_load_model_only=False
    )
    assert CheckpointManager(cfg, run.states(), work / "back").load() == 0
    assert_same(ref["model"], full_model(run.model), "model FSDP 2 x TP 2 -> 1 rank")
    assert_same(
        ref["optimizer"],
        full_optimizer(run.model, run.optimizer),
        "optimizer FSDP 2 x TP 2 -> 1 rank",
    )


def test_seed_checkpoint_written_by_one_process_loads_under_fsdp2(results):
    _check(results, "seed_checkpoint_loads_in_fsdp2")


def test_a_corrupt_file_found_by_one_rank_makes_every_rank_fall_back(results):
    _check(results, "corrupt_file_checked_by_rank_1_makes_every_rank_fall_back")


def test_nan_in_one_ranks_shard_refuses_the_save_on_every_rank(results):
    _check(results, "nan_in_one_ranks_shard_refuses_the_save_on_every_rank")


def test_hf_conversions_on_2_ranks_write_what_one_process_writes(results):
    _check(results, "hf_conversions_on_2_ranks_write_what_one_process_writes")
