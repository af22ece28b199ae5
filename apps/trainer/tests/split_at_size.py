"""Run by test_shipped_configs_dry_run.py in a process of its own (a fake default process group
cannot live beside a real one): for each shipped config named, its checks at its world size,
then its real-size model through the trainer's parallelize path on the meta device under a
fake group of that size, as the last rank (the last pipeline stage's, which holds experts). Prints one JSON line, per config: the problems found,
the layout, the rank's local shape of its first MoE layer's w1 and its number of parameter
elements."""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.tensor import DTensor

from titan_core import load_config
from titan_parallel.memory_estimate import fake_process_group
from titan_trainer.config import JobConfig
from titan_trainer.layout import layout_text
from titan_trainer.loss import cross_entropy_loss
from titan_trainer.model import build_converters, build_model
from titan_trainer.preflight import preflight_problems
from titan_trainer.runtime import build_parallel_runtime
from titan_trainer.shipped import find_config_file


def split(name: str) -> dict:
    args = ["--job.config_file", name, "--job.dump_folder", "/tmp/titan-split-at-size"]
    config = load_config(JobConfig, args, find_config_file=find_config_file)
    world = config.dry_run.world_size
    problems, _notes, vocab = preflight_problems(config, world, dry_run=True)
    with fake_process_group(world, world - 1):
        dims = config.parallelism.build_parallel_dims(world)
        dims.build_mesh("cpu")
        runtime = build_parallel_runtime(
            config, dims, torch.device("cpu"), torch.bfloat16, 0, cross_entropy_loss
        )
        parts = build_model(config, runtime, vocab, build_converters(config, dims))
        local = [
            p.to_local() if isinstance(p, DTensor) else p
            for part in parts
            for p in part.parameters()
        ]
        w1 = next(m.experts.w1 for part in parts for m in part.modules() if hasattr(m, "moe_plan"))
        report = {
            "problems": problems,
            "layout": layout_text(dims),
            "expert_w1": list(w1.to_local().shape),
            "local_parameters": sum(t.numel() for t in local),
        }
    return report


if __name__ == "__main__":
    # Several configs, one after the other: each in a fake group of its own world size.
    print(json.dumps({name: split(name) for name in sys.argv[1:]}))
