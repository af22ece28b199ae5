"""8-process trainer runs composing three parallelisms on CPU, against one process.

Pipeline stages initialise only their own modules, so every run starts from one seed
checkpoint written by a single process (the workflow a cluster uses too).
"""

from __future__ import annotations

import pytest
from conftest import STEPS, fp32_args, parse_losses, run_cli


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed")
    result = run_cli(
        [
            "--job.config_file",
            "apps/trainer/configs/debug_model.toml",
            "--job.dump_folder",
            str(out),
            "--training.seq_len",
            "128",
            "--checkpoint.create_seed_checkpoint",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    step0 = out / "checkpoint" / "step-0"
    assert step0.is_dir()
    return str(step0)


def _args(tmp, dataset, seed):
    return [
        *fp32_args(
            [
                "--job.config_file",
                "apps/trainer/configs/debug_model.toml",
                "--job.dump_folder",
                str(tmp),
                "--training.seq_len",
                "128",
                "--metrics.log_freq",
                "1",
            ],
            dataset,
        ),
        "--checkpoint.initial_load_path",
        seed,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, same_doc_dataset, seed_checkpoint):
    result = run_cli(
        [
            *_args(tmp_path_factory.mktemp("ref4d"), same_doc_dataset, seed_checkpoint),
            "--training.global_batch_size",
            "8",
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return parse_losses(result.stdout)


LAYOUTS = {
    "fsdp2_tp2_pp2": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
    "fsdp2_cp2_tp2": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.context_parallel_degree",
        "2",
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_three_way_layout_on_8_processes_matches_one_process(
    layout, tmp_path, same_doc_dataset, seed_checkpoint, reference
):
    result = run_cli(
        [*_args(tmp_path, same_doc_dataset, seed_checkpoint), *LAYOUTS[layout]],
        nproc=8,
        timeout=800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        # fp32, different reduction orders only; printed with 4 decimals.
        assert loss == pytest.approx(reference[step], abs=2e-4), (layout, step)
