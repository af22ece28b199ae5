"""8-process trainer runs composing three parallelisms on CPU, against one process.

No seed checkpoint: initial weights are a function of (seed, parameter name), so pipeline
stages, TP and FSDP shards all start from the weights the single process draws.
"""

from __future__ import annotations

import pytest
from conftest import STEPS, fp32_args, parse_losses, run_cli


def _args(tmp, dataset):
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
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, same_doc_dataset):
    result = run_cli(
        [
            *_args(tmp_path_factory.mktemp("ref4d"), same_doc_dataset),
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
    layout, tmp_path, same_doc_dataset, reference
):
    result = run_cli(
        [*_args(tmp_path, same_doc_dataset), *LAYOUTS[layout]],
        nproc=8,
        timeout=800,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        # fp32, different reduction orders only; printed with 4 decimals.
        assert loss == pytest.approx(reference[step], abs=2e-4), (layout, step)
