"""Trains the QK-Clip test model (`qk_clip_testmodel`) with Muon and QK-Clip for a few steps,
in one process or on each rank of a gloo group under FSDP2 or TP2, and returns the final
full weights and each step's largest logit (rank 0's)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from qk_clip_testmodel import TinyModel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from titan_parallel import Muon, QKClip, muon_param_groups

STEPS, BATCH, SEQ, TAU = 4, 4, 16, 3.0


def _model(kind: str) -> TinyModel:
    torch.manual_seed(0)
    model = TinyModel(kind)
    with torch.no_grad():  # sharp enough that the clip works on every step
        for layer in model.layers:
            for rows in layer.qk_clip_layout().rows:
                rows.weight.mul_(3.0)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(kind: str, layout: str = "one") -> dict:
    model = _model(kind)
    inputs, labels = _batch()
    tp_mesh = dp_mesh = None
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        dp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        share = BATCH // dist.get_world_size()
        rank = dist.get_rank()
        inputs, labels = (t[rank * share : (rank + 1) * share] for t in (inputs, labels))
    elif layout == "tp2":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                "wo": RowwiseParallel()}  # fmt: skip
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, plan)
    clip = QKClip([model], TAU, tp_mesh=tp_mesh, reduce_meshes=[dp_mesh])
    optimizer = Muon(muon_param_groups(model), lr=0.02, ns_dtype=torch.float32)
    logits = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        logits.append(clip.clip_().item())
    weights = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return {"weights": weights, "logits": logits}


def _rank(rank: int, world: int, store: str, out: str, cases: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    try:
        for kind, layout in cases:
            results[f"{kind}_{layout}"] = train(kind, layout)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def run_ranks(world: int, cases: list[tuple[str, str]], folder: str) -> dict:
    """Each case on `world` gloo ranks (spawned once); rank 0's results by `kind_layout`."""
    import torch.multiprocessing as mp

    out = os.path.join(folder, "results.pt")
    mp.spawn(_rank, args=(world, os.path.join(folder, "store"), out, cases), nprocs=world)
    return torch.load(out)
