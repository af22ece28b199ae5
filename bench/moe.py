"""Mixture-of-experts experts: one grouped matmul per weight (`torch._grouped_mm`) against the
per-expert loop, forward and backward of the whole MoE layer, side by side in one run, as JSON
lines.

    uv run python bench/moe.py [--shape qwen3-30b-a3b|small] [--tokens 4096] [--iters 5] [--device cpu]

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

import torch

from titan_models.moe import MoE, MoEArgs

SHAPES = {
    "small": (256, MoEArgs(num_experts=16, top_k=2, hidden_dim=512)),
    "qwen3-30b-a3b": (2048, MoEArgs(num_experts=128, top_k=8, hidden_dim=768, route_norm=True)),
}


def emit(**record) -> None:
    print(json.dumps({"bench": "moe", **record}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    dim, args = SHAPES[a.shape]
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


if __name__ == "__main__":
    main()
