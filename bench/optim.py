"""Optimizer step time: Ranger21 (every component on; eager foreach passes and the compiled,
fused kernels), bfloat16-state variants and Muon (Newton-Schulz in bfloat16 and in float32)
against torch's AdamW (foreach), on the Llama 3.1 104M flavor (`100M`), side by side in one
run, as JSON lines.

    uv run python bench/optim.py [--flavor 100M] [--vocab-size 2048] [--iters 10] [--device cpu]

Each optimizer steps the same parameters with the same (fixed, random) gradients; the steps
are interleaved round-robin so that a noisy machine slows them alike, and each line carries
the median step time and its ratio to AdamW foreach (target for Ranger21: at most 1.5).
Compare ratios, not absolute times, across machines. `--vocab-size` defaults to the byte
tokenizer's 2048 so that the model is its ~104M-parameter body; pass 128256 for Llama 3's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="100M")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    ap.add_argument("--only", nargs="*", help="names of the optimizers to time (default: all)")
    return ap.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch

from titan_models.llama3 import llama3_spec
from titan_parallel import AdamW, Muon, Ranger21, uses_muon


def emit(**record) -> None:
    print(json.dumps({"bench": "optim", **record}), flush=True)


def build_params(
    flavor: str, vocab_size: int, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    args = llama3_spec.flavors[flavor]
    args = type(args)(**{**args.__dict__, "vocab_size": vocab_size})
    with torch.device("meta"):
        model = llama3_spec.build(args)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for name, p in model.named_parameters():
        with torch.no_grad():
            p.normal_(0, 0.02, generator=gen)
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        params.append((name, p))
    return params


def muon(names: list[str], ns_dtype: torch.dtype):
    """Muon over the hidden matrices, AdamW over the embedding, norms and head (the trainer's
    default grouping)."""

    def make(ps: list[torch.Tensor]) -> Muon:
        hidden = [uses_muon(n, p, n.startswith("tok_embeddings")) for n, p in zip(names, ps)]
        groups = [
            {"params": [p for p, h in zip(ps, hidden) if h], "use_muon": True},
            {"params": [p for p, h in zip(ps, hidden) if not h], "use_muon": False},
        ]
        return Muon(groups, lr=1e-3, adjust_lr="match_rms_adamw", ns_dtype=ns_dtype)

    return make


def main(a: argparse.Namespace) -> None:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    named = build_params(a.flavor, a.vocab_size, device)
    names, params = [n for n, _ in named], [p for _, p in named]
    n = sum(p.numel() for p in params)
    emit(flavor=a.flavor, vocab_size=a.vocab_size, parameters=n, device=str(device))
    # Each optimizer gets its own copy of the parameters (the same values and gradients).
    makers = {
        "AdamW foreach (torch)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "AdamW fused (torch)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "Ranger21": lambda ps: Ranger21(ps, lr=1e-3, total_steps=10_000),
        "Ranger21 compiled": lambda ps: Ranger21(ps, lr=1e-3, total_steps=10_000, compiled=True),
        "Ranger21 bf16 states": lambda ps: Ranger21(
            ps, lr=1e-3, total_steps=10_000, state_dtype=torch.bfloat16
        ),
        "AdamW bf16 states (titan-parallel)": lambda ps: AdamW(
            ps, lr=1e-3, state_dtype=torch.bfloat16
        ),
        "Muon, Newton-Schulz in bf16": muon(names, torch.bfloat16),
        "Muon, Newton-Schulz in fp32": muon(names, torch.float32),
    }
    if a.only:
        makers = {k: v for k, v in makers.items() if k in a.only or k.startswith("AdamW foreach")}
    runs = {}
    for name, make in makers.items():
        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for c, p in zip(copies, params):
            c.grad = p.grad.clone()
        opt = make(copies)
        opt.step()  # states created; one warm-up step (and the compile, for compiled ones)
        runs[name] = (opt, [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(a.iters):
        for opt, times in runs.values():
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
    base = statistics.median(runs["AdamW foreach (torch)"][1])
    for name, (opt, times) in runs.items():
        state_bytes = sum(
            v.numel() * v.element_size()
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
        med = statistics.median(times)
        emit(
            optimizer=name,
            step_s=round(med, 4),
            ratio_to_adamw_foreach=round(med / base, 3),
            state_gib=round(state_bytes / 2**30, 3),
            iters=a.iters,
        )


if __name__ == "__main__":
    main(ARGS)
