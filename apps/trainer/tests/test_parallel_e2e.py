"""Multi-process trainer runs through torchrun on CPU (gloo), compared with one process."""

from __future__ import annotations

import pytest
from conftest import STEPS, fp32_args, parse_losses, run_cli, start_cli

from titan_trainer.compare import main as compare


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, same_doc_dataset):
    """One process, global batch 8 (2 microbatches of 4 accumulated), fp32."""
    out = tmp_path_factory.mktemp("ref")
    args = fp32_args(
        [
            "--job.config_file",
            "apps/trainer/configs/debug_model.toml",
            "--job.dump_folder",
            str(out),
            "--training.seq_len",
            "128",
            "--metrics.log_freq",
            "1",
        ],
        same_doc_dataset,
    )
    result = run_cli(
        [*args, *_validation(same_doc_dataset), "--training.global_batch_size", "8", *_TB]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return parse_losses(result.stdout), _validation_losses(result.stdout), out


# TensorBoard on, for `titan-compare` (fp32_args turns it off).
_TB = ["--metrics.enable_tensorboard", "true"]


def _validation(dataset: str) -> list[str]:
    # Validation on the same identical samples: its loss cannot depend on how they are split.
    return [
        *("--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"),
        *("--validation.dataset", dataset, "--validation.local_batch_size", "4"),
    ]


def _validation_losses(stdout: str) -> dict[int, float]:
    return {
        int(line.split("step")[1].split("|")[0]): float(line.split("validation loss")[1])
        for line in stdout.splitlines()
        if "| validation loss" in line
    }


def test_fsdp2_x_tp2_on_4_processes_with_validation_matches_one_process(
    debug_args, reference_losses, same_doc_dataset
):
    # 2 data-parallel ranks x local batch 4 = the reference's global batch of 8, same samples.
    result = run_cli(
        [
            *fp32_args(debug_args, same_doc_dataset),
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            *_validation(same_doc_dataset),
            *_TB,
        ],
        nproc=4,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference_losses, reference_validation, reference_folder = reference_losses
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        # fp32 with different reduction orders (sharded matmuls, reduce-scatter of grads): ~1e-6
        # relative per step; the log prints 4 decimals, so compare at that resolution.
        assert loss == pytest.approx(reference_losses[step], abs=2e-4), step
    # The identical samples are memorised fast: the comparison covers a moving loss.
    assert losses[STEPS] < losses[1] - 0.5
    # Validation under FSDP x TP (its collectives included) gives the one-process numbers.
    validation = _validation_losses(result.stdout)
    assert sorted(validation) == sorted(reference_validation) == [2, 4]
    for step, loss in validation.items():
        assert loss == pytest.approx(reference_validation[step], abs=2e-4), step
    # The same check as a CI job would write it: titan-compare on the two run folders, with
    # the tolerance above, reading what TensorBoard holds (full precision, not the log's 4
    # decimals).
    run_folder = debug_args[debug_args.index("--job.dump_folder") + 1]
    for metric in ("loss", "validation_loss"):
        assert compare([str(reference_folder), run_folder, "--metric", metric, "--plot", "",
                        "--tolerance", "2e-4"]) == 0, metric  # fmt: skip


def test_pipeline_without_seed_checkpoint_matches_one_process_for_5_steps(
    tmp_path_factory, same_doc_dataset
):
    # Each pipeline stage initialises only the blocks it holds, with the values one process
    # draws (a function of seed and parameter name), so no seed checkpoint is needed.
    def start(nproc: int, extra: list[str]):
        out = tmp_path_factory.mktemp(f"pp{nproc}")
        args = fp32_args(
            [
                "--job.config_file",
                "apps/trainer/configs/debug_model.toml",
                "--job.dump_folder",
                str(out),
                "--training.seq_len",
                "128",
                "--metrics.log_freq",
                "1",
            ],
            same_doc_dataset,
        )
        return start_cli(
            [*args, "--training.steps", "5", "--training.local_batch_size", "8", *extra],
            nproc=nproc,
        )

    def losses(started) -> dict[int, float]:
        result = started.result()
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return parse_losses(result.stdout)

    # Side by side: much of each run is start-up, and the one-process run computes on one core.
    single = start(1, [])
    pipelined = start(
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.pipeline_parallel_microbatch_size",
            "4",
        ],
    )
    single, pipelined = losses(single), losses(pipelined)
    assert sorted(pipelined) == list(range(1, 6))
    for step in single:
        # fp32; the stages sum the two microbatches' gradients in another order (measured
        # differences are below the 4 printed decimals).
        assert pipelined[step] == pytest.approx(single[step], rel=1e-4), (step, single, pipelined)
