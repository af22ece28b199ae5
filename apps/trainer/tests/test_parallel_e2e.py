"""Multi-process trainer runs through torchrun on CPU (gloo), compared with one process."""

from __future__ import annotations

import pytest
from conftest import parse_losses, run_cli

STEPS = 4
# Every document is the same 127 bytes: with BOS and EOS it fills exactly one 129-token window
# (seq_len 128 + 1), so every sample on every rank is identical. Sharding the data across
# data-parallel ranks then cannot change a batch, and the runs can be compared step by step.
TEXT = (
    "The quick brown fox jumps over the lazy dog while seventeen wizards quietly boxed "
    "jackdaws; pack my box with five dozen jugs, now!"
)[:127]


@pytest.fixture(scope="module")
def same_doc_dataset(tmp_path_factory):
    import json

    assert len(TEXT.encode()) == 127
    path = tmp_path_factory.mktemp("data") / "same.jsonl"
    path.write_text("".join(json.dumps({"text": TEXT}) + "\n" for _ in range(256)))
    return str(path)


def _fp32_args(debug_args, dataset):
    return [
        *debug_args,
        "--training.dataset",
        dataset,
        "--training.steps",
        str(STEPS),
        "--training.mixed_precision_param",
        "float32",
        "--training.local_batch_size",
        "4",
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_tflops",
        "1",
    ]


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, same_doc_dataset):
    """One process, global batch 8 (2 microbatches of 4 accumulated), fp32."""
    out = tmp_path_factory.mktemp("ref")
    args = _fp32_args(
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
    result = run_cli([*args, "--training.global_batch_size", "8"])
    assert result.returncode == 0, result.stdout + result.stderr
    return parse_losses(result.stdout)


def test_fsdp2_x_tp2_on_4_processes_matches_one_process(
    debug_args, reference_losses, same_doc_dataset
):
    # 2 data-parallel ranks x local batch 4 = the reference's global batch of 8, same samples.
    result = run_cli(
        [
            *_fp32_args(debug_args, same_doc_dataset),
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        nproc=4,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        # fp32 with different reduction orders (sharded matmuls, reduce-scatter of grads): ~1e-6
        # relative per step; the log prints 4 decimals, so compare at that resolution.
        assert loss == pytest.approx(reference_losses[step], abs=2e-4), step
    # The identical samples are memorised fast: the comparison covers a moving loss.
    assert losses[STEPS] < losses[1] - 0.5
