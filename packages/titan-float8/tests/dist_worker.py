"""Runs in each of the 2 spawned gloo processes: every distributed case, one process group."""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from float8_toy import TinyLM, batches, train  # noqa: E402

from titan_core import ParallelDims  # noqa: E402
from titan_float8 import Float8, build_float8_converter, float8_tp_styles  # noqa: E402

SIZE = dict(vocab=64, dim=32, hidden=64)  # TinyLM defaults, spelled out
STEPS = 5


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def fsdp_case(dims: ParallelDims, section: Float8, rank: int) -> dict:
    """The trainer's order: meta build -> convert -> fully_shard -> to_empty -> init -> train."""
    from torch.distributed.fsdp import fully_shard

    converter = build_float8_converter(section, dims)
    with torch.device("meta"):
        model = TinyLM(**SIZE)
    converter.convert(model)
    mesh = dims.mesh("fsdp")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    losses = train(
        model,
        batches(STEPS, batch=4, seq=16, vocab=SIZE["vocab"], seed=rank),
        converter.post_optimizer_hook,
    )
    return {"losses": losses, "params": _full_params(model), "converted": converter.converted}


def tp_case(dims: ParallelDims, section: Float8, float8_styles: bool) -> dict:
    """TP 2 over the feed-forward pair, against the same Float8 model in this one process."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    data = batches(
        STEPS, batch=4, seq=16, vocab=SIZE["vocab"], seed=7
    )  # same batches on both ranks
    runs = {}
    for name in ("reference", "tp"):
        torch.manual_seed(0)
        model = TinyLM(**SIZE)
        build_float8_converter(section, dims).convert(model)
        if name == "tp":
            styles = (
                float8_tp_styles(section)
                if float8_styles
                else {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            )
            plan = {}
            for i in model.layers:
                plan[f"layers.{i}.w1"] = styles["colwise"]()
                plan[f"layers.{i}.w2"] = styles["rowwise"]()
            parallelize_module(model, dims.mesh("tp"), plan)
        model.init_weights()
        runs[name] = train(model, data)
    return runs


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(
            seconds=120
        ),  # a failing case ends the run instead of hanging it
    )
    results = {}
    try:
        fsdp = ParallelDims(world_size=world)
        fsdp.build_mesh("cpu")
        base = Float8(emulate=True)
        results["fsdp_bf16_all_gather"] = fsdp_case(fsdp, base, rank)
        results["fsdp_float8_all_gather"] = fsdp_case(
            fsdp, dataclasses.replace(base, enable_fsdp_float8_all_gather=True), rank
        )
        results["fsdp_float8_all_gather_precompute"] = fsdp_case(
            fsdp,
            dataclasses.replace(
                base,
                enable_fsdp_float8_all_gather=True,
                precompute_float8_dynamic_scale_for_fsdp=True,
            ),
            rank,
        )
        tp = ParallelDims(world_size=world, tp=world)
        tp.build_mesh("cpu")
        results["tp_tensorwise_float8_styles"] = tp_case(tp, base, float8_styles=True)
        results["tp_rowwise_plain_styles"] = tp_case(
            tp, Float8(recipe_name="rowwise", emulate=True), float8_styles=False
        )
    except Exception:
        results["error"] = traceback.format_exc()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()
