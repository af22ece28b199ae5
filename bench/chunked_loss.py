"""The chunked linear + cross-entropy (`[training] loss_chunk_tokens`,
`titan_parallel.chunked_cross_entropy`) against the whole-batch loss: peak memory and time of
one forward + backward of the output projection and the loss, as JSON lines.

    uv run python bench/chunked_loss.py                        # 2048 tokens, dim 256, vocab 32768
    uv run python bench/chunked_loss.py --tokens 8192 --dim 4096 --vocab 128256 --device cuda

Each variant (`--chunks`, 0: the whole batch) runs on the same hidden states, weight and
labels; the timed steps are interleaved round-robin, so a noisy machine slows them alike, and
each variant's record gives its median and its ratios to the whole-batch loss. The peak is
`torch.cuda.max_memory_allocated` on a GPU, and on a CPU what torch's memory tracker
(`titan_parallel.StepMemoryTracker`) counts in one more step: the bytes the step allocates
beyond its inputs, the weight and its gradient included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunks", default="0,1024,256", help="chunk sizes; 0: whole batch")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch
import torch.nn.functional as F

from titan_parallel import StepMemoryTracker, chunked_cross_entropy


def _loss(hidden, weight, labels, chunk: int) -> torch.Tensor:
    if chunk == 0:
        return F.cross_entropy(F.linear(hidden, weight).float(), labels)
    return chunked_cross_entropy(hidden, weight, labels, chunk)


def _step(hidden, weight, labels, chunk: int) -> float:
    hidden.grad = weight.grad = None
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    _loss(hidden, weight, labels, chunk).backward()
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _peak(hidden, weight, labels, chunk: int) -> int:
    hidden.grad = weight.grad = None
    if hidden.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _loss(hidden, weight, labels, chunk).backward()
        return torch.cuda.max_memory_allocated() - before
    holder = torch.nn.Module()
    holder.weight = weight
    tracker = StepMemoryTracker([holder], None)
    with tracker:
        _loss(hidden, weight, labels, chunk).backward()
    return tracker.peak().total


def main(args: argparse.Namespace) -> None:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    chunks = [int(c) for c in args.chunks.split(",")]
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, generator=g) * args.dim**-0.5).to(device, dtype)
    weight.requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)

    peaks = {c: _peak(hidden, weight, labels, c) for c in chunks}
    for c in chunks:  # warm-up
        _step(hidden, weight, labels, c)
    times: dict[int, list[float]] = {c: [] for c in chunks}
    for _ in range(args.steps):
        for c in chunks:
            times[c].append(_step(hidden, weight, labels, c))
    base = chunks[0]
    logits = args.tokens * args.vocab * 4
    for c in chunks:
        median = statistics.median(times[c])
        record = {
            "bench": "chunked_loss",
            "chunk_tokens": c,
            "tokens": args.tokens,
            "dim": args.dim,
            "vocab": args.vocab,
            "dtype": args.dtype,
            "device": str(device),
            "fp32_logits_mib": round(logits / 2**20, 1),
            "peak_mib": round(peaks[c] / 2**20, 1),
            "step_s": round(median, 4),
            "peak_ratio": round(peaks[c] / peaks[base], 3),
            "time_ratio": round(median / statistics.median(times[base]), 3),
            "load_1min": round(os.getloadavg()[0], 2),
            "torch": torch.__version__,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(ARGS)
