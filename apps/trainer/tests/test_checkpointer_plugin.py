"""A user swaps in another checkpoint package by naming it in the config."""

from __future__ import annotations

import third_party_ckpt

from titan_core import load_config
from titan_trainer.config import JobConfig
from titan_trainer.train import train


def test_trainer_uses_a_third_party_checkpointer_named_in_the_config(tmp_path):
    args = [
        "--job.dump_folder",
        str(tmp_path),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "4",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_tflops",
        "1",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.checkpointer",
        "third_party_ckpt:build",
    ]
    third_party_ckpt.CALLS.clear()
    train(load_config(JobConfig, args))
    assert third_party_ckpt.CALLS == [("save", 2), ("save", 4), ("close", -1)]
    assert (tmp_path / "weights_only" / "model.safetensors").is_file()
    # A second start resumes through the same plugin.
    third_party_ckpt.CALLS.clear()
    result = train(load_config(JobConfig, [*args, "--training.steps", "5"]))
    assert third_party_ckpt.CALLS[0] == ("load", 4)
    assert result.steps_run == 1 and result.final_step == 5
