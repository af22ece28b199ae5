"""Mixture-of-experts experts: one grouped matmul per weight (`torch._grouped_mm`) against the
per-expert loop, forward and backward of the whole MoE layer, side by side in one run, as JSON
lines; then what expert parallel adds: the token exchange (all-to-all dispatch and combine,
forward and backward, on gloo between `--ep` processes) against the experts' own grouped
matmuls on the rows each rank receives.

    uv run python bench/moe.py [--shape qwen3-30b-a3b|small] [--tokens 4096] [--iters 5] [--device cpu] [--ep 2]

Shapes: `small` (dim 256, 16 experts of 512, top-2) and `qwen3-30b-a3b` (one layer of
Qwen3-30B-A3B: dim 2048, 128 experts of 768, top-8). Both paths get the same layer weights and
the same tokens; their timings are interleaved round-robin so that a noisy machine slows them
alike, and each line carries the median time and the loop/grouped ratio. Compare ratios, not
absolute times, across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# Each shape: the model width and the MoE layer's arguments (titan_models.moe.MoEArgs).
SHAPES = {
    "small": (256, dict(num_experts=16, top_k=2, hidden_dim=512)),
    "qwen3-30b-a3b": (2048, dict(num_experts=128, top_k=8, hidden_dim=768, route_norm=True)),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--ep", type=int, default=2, help="processes for the exchange; 1: skip it")
    return ap.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch

from titan_models.moe import MoE, MoEArgs


def emit(**record) -> None:
    print(json.dumps({"bench": "moe", **record}), flush=True)


def main(a: argparse.Namespace) -> None:
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    dim, moe_args = SHAPES[a.shape]
    args = MoEArgs(**moe_args)
    torch.manual_seed(0)
    layers = {}
    for grouped in (True, False):
        torch.manual_seed(0)
        layer = MoE(dim, MoEArgs(**{**args.__dict__, "use_grouped_mm": grouped}))
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layers["grouped_mm" if grouped else "loop"] = layer.to(device=device, dtype=dtype)
    x = torch.randn(1, a.tokens, dim, device=device, dtype=dtype)
    emit(shape=a.shape, dim=dim, experts=args.num_experts, top_k=args.top_k,
         hidden=args.hidden_dim, tokens=a.tokens, device=str(device), dtype=a.dtype)  # fmt: skip

    def step(layer: MoE) -> float:
        xi = x.detach().requires_grad_()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        layer(xi).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in layers}
    for layer in layers.values():
        step(layer)  # warm-up
    for _ in range(a.iters):
        for name, layer in layers.items():
            times[name].append(step(layer))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, median in medians.items():
        emit(path=name, median_s=round(median, 5),
             tokens_per_s=round(a.tokens / median), ratio_loop_over_this=round(medians["loop"] / median, 3))  # fmt: skip
    if a.ep > 1:
        bench_exchange(a, dim, args)


def bench_exchange(a, dim: int, args: MoEArgs) -> None:
    """`a.ep` gloo processes, each routing `a.tokens` tokens of its own: the median time of the
    exchange (dispatch + combine, forward and backward) and of the local experts on the rows
    received, interleaved; rank 0 reports."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_exchange_worker, args=(a, dim, args, tmp), nprocs=a.ep, join=True)
        with open(f"{tmp}/result.json") as f:
            emit(**json.load(f))


def _exchange_worker(rank: int, a, dim: int, args: MoEArgs, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_parallel.token_dispatch import combine, dispatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=a.ep)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (a.ep,))
    torch.manual_seed(0)
    layer = MoE(dim, args)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    experts = layer.experts
    for name in ("w1", "w2", "w3"):  # this rank's experts only, as expert parallel holds them
        full = getattr(experts, name).data
        experts.register_parameter(
            name, torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        )
    torch.manual_seed(1 + rank)  # each rank its own tokens
    tokens = torch.randn(a.tokens, dim)
    _, chosen, _ = layer.router(tokens)
    flat = chosen.flatten()
    counts = torch.bincount(flat, minlength=args.num_experts)
    rows = tokens[flat.argsort(stable=True) // args.top_k].detach()
    group = mesh.get_group()

    def exchange() -> float:
        x = rows.clone().requires_grad_()
        start = time.perf_counter()
        local, _, ex = dispatch(x, counts, group)
        combine(local * 1.0, ex).square().mean().backward()
        return time.perf_counter() - start

    local_rows, local_counts, _ = dispatch(rows, counts, group)

    def compute() -> float:
        x = local_rows.detach().requires_grad_()
        start = time.perf_counter()
        experts(x, local_counts).square().mean().backward()
        return time.perf_counter() - start

    exchange(), compute()  # warm-up
    times: dict[str, list[float]] = {"exchange": [], "experts": []}
    for _ in range(a.iters):
        dist.barrier()
        times["exchange"].append(exchange())
        dist.barrier()
        times["experts"].append(compute())
    medians = {k: statistics.median(v) for k, v in times.items()}
    if rank == 0:
        with open(f"{tmp}/result.json", "w") as f:
            json.dump({"path": f"ep{a.ep}_gloo", "rows_sent": int(rows.shape[0]),
                       "rows_received": int(local_rows.shape[0]),
                       "exchange_median_s": round(medians["exchange"], 5),
                       "experts_median_s": round(medians["experts"], 5),
                       "ratio_exchange_over_experts": round(medians["exchange"] / medians["experts"], 3)}, f)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
