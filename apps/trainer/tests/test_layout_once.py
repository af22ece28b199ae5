"""The layout is resolved once: the pre-start checks build the `ParallelDims` and the model on
the meta device once, every check that needs the model reads that one, and the run is handed
it (`Layout.take_model`) instead of building its own."""

from __future__ import annotations

import dataclasses

from titan_core import load_config
from titan_models.llama3 import llama3_spec
from titan_trainer.config import JobConfig
from titan_trainer.preflight import preflight

BUILDS: list = []


def _counted_build(args):
    BUILDS.append(args)
    return llama3_spec.build(args)


spec = dataclasses.replace(llama3_spec, build=_counted_build)
"""Llama 3, counting its builds (`--model.name test_layout_once:spec`)."""


def test_the_checks_build_the_model_once_and_hand_it_to_the_run(tmp_path):
    # Every check that reads the model is on: tensor parallel (the plan), block-causal
    # attention (the forward's arguments), checkpoints (their disk space).
    args = [
        "--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path),
        "--model.name", "test_layout_once:spec",
        "--parallelism.tensor_parallel_degree", "2",
        "--model.attn_mask_type", "block_causal",
        "--checkpoint.enable",
    ]  # fmt: skip
    from titan_trainer.shipped import find_config_file

    config = load_config(JobConfig, args, find_config_file=find_config_file)
    BUILDS.clear()
    checked = preflight(config, 2)
    assert checked.problems == []
    assert len(BUILDS) == 1  # the TP, attention and disk-space checks read one model
    assert (checked.layout.dims.tp, checked.layout.dims.dp_shard) == (2, 1)
    model = checked.layout.meta_model()
    assert checked.layout.take_model(checked.vocab_size) is model  # the run's model
    assert len(BUILDS) == 1
