"""Multi-process trainer runs through torchrun on CPU (gloo), compared with one process."""

from __future__ import annotations

from pathlib import Path

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
            # Timed by rank 0 on its shape (heads halved by TP), the pick broadcast; the
            # reference runs torch's own choice.
            "--model.attention_backend",
            "auto",
        ],
        nproc=4,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "attention: " in output and " for 4x128, 8/4 heads of 16, float32 on cpu (" in output
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


def test_pipeline_x_fsdp_trains_and_validates_like_one_process_for_5_steps(
    tmp_path_factory, same_doc_dataset
):
    """PP 2 x FSDP 2 on 4 processes against one process: the training losses without a seed
    checkpoint, and the validation loss through the pipeline's forward-only schedule, over
    held-out batches whose two data-parallel halves count uneven numbers of tokens."""

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
        # The held-out split of the embedded corpus, sample g of each batch keeping its first
        # 128 // (g + 1) labels (masked_data): data-parallel rank 0 (samples 0-3) counts 266
        # tokens per batch, rank 1 (samples 4-7) 80.
        validation = [
            *("--validation.enable", "--validation.freq", "5", "--validation.steps", "2"),
            *("--training.data_plugin", "masked_data:data_spec"),
        ]
        return start_cli(
            [*args, "--training.steps", "5", *validation, *extra],
            nproc=nproc,
            env_extra={"PYTHONPATH": str(Path(__file__).parent)},  # where masked_data lives
        )

    def collect(started) -> tuple[dict[int, float], dict[int, float]]:
        result = started.result(900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return parse_losses(result.stdout), _validation_losses(result.stdout)

    # Both at once: much of each is importing torch and waiting at rendezvous.
    one = start(1, ["--training.local_batch_size", "8", "--validation.local_batch_size", "8"])
    four = start(
        4,
        [
            *("--parallelism.pipeline_parallel_degree", "2"),
            *("--parallelism.data_parallel_shard_degree", "2"),
            *("--parallelism.pipeline_parallel_microbatch_size", "2"),
            *("--training.local_batch_size", "4", "--validation.local_batch_size", "4"),
        ],
    )
    single, single_validation = collect(one)
    pipelined, pipelined_validation = collect(four)
    assert sorted(pipelined) == list(range(1, 6))
    for step in single:
        # fp32; the stages sum the two microbatches' gradients in another order (measured
        # differences are below the 4 printed decimals).
        assert pipelined[step] == pytest.approx(single[step], rel=1e-4), (step, single, pipelined)
    # The mean over every counted token, as one process takes it. fp32 sums in another order
    # differ by ~1e-6; the log prints 4 decimals. The mean of the two ranks' means (what
    # validation took before) is 0.18 away on this data (5.656 against 5.832, under FSDP 2).
    assert sorted(pipelined_validation) == sorted(single_validation) == [5]
    assert pipelined_validation[5] == pytest.approx(single_validation[5], abs=1.5e-4)
