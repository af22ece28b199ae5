"""Gradient accumulation over k microbatches gives the update of one k-times larger batch."""

from __future__ import annotations

import pytest

from titan_core import load_config
from titan_trainer.config import JobConfig
from titan_trainer.train import train


def _run(tmp_path, name, local, global_batch):
    cfg = load_config(
        JobConfig,
        [
            "--job.dump_folder",
            str(tmp_path / name),
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            str(local),
            "--training.global_batch_size",
            str(global_batch),
            "--training.steps",
            "4",
            "--training.mixed_precision_param",
            "float32",
            "--lr_scheduler.warmup_steps",
            "0",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_tflops",
            "1",
            "--activation_checkpoint.mode",
            "none",
        ],
    )
    return train(cfg).losses


def test_accumulating_four_microbatches_equals_one_big_batch(tmp_path):
    big = _run(tmp_path, "big", local=8, global_batch=8)
    accumulated = _run(tmp_path, "acc", local=2, global_batch=8)
    # fp32; the only difference is the order of the summation over samples (4 partial means vs
    # one mean), which moves the loss by rounding only: ~1e-7 relative per step, compounding a
    # little through Adam's updates over 4 steps.
    assert accumulated == pytest.approx(big, rel=1e-5)
