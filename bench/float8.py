"""bf16 vs Float8 forward+backward throughput, measured side by side in one run, as JSON lines.

    uv run python bench/float8.py [--tokens 16384] [--recipes tensorwise,rowwise] [--iters 20]

Two parts, both compiled with torch.compile (Float8 only pays off compiled):
- single linear layers with Llama 3.1 8B shapes (K x N: 4096x4096 attention, 4096x14336 and
  14336x4096 feed-forward, 4096x1024 key/value), M = --tokens;
- a small full transformer (--dim, --layers), converted by titan-float8 exactly as the trainer
  does (output projection kept in bf16).

Each line carries the bf16 and Float8 times and their ratio; compare ratios, not absolute
times, across machines. On a CPU, or a GPU without Float8 (capability < 8.9), it prints one line
saying Float8 has no speed benefit there and exits 0.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384, help="M: tokens per forward")
    parser.add_argument("--recipes", default="tensorwise,rowwise")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=2048)
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch
import torch.nn.functional as F
from torch import nn

from titan_float8 import Float8, build_float8_converter

LLAMA_8B_LINEARS = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024)]  # (K, N)


def emit(**record) -> None:
    print(json.dumps({"bench": "float8", **record}), flush=True)


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.n_heads, -1).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class SmallLM(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, hidden: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def time_fwd_bwd(step, iters: int, warmup: int = 3) -> float:
    """Median seconds of one forward+backward; the warm-up absorbs compilation."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def convert(model: nn.Module, recipe: str | None) -> nn.Module:
    if recipe is not None:
        build_float8_converter(Float8(recipe_name=recipe), dims=None, device="cuda").convert(model)
    return torch.compile(model)


def bench_linear(k: int, n: int, recipe: str, args) -> None:
    x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
    seconds = {}
    for name, rec in (("bf16", None), ("float8", recipe)):
        torch._dynamo.reset()
        holder = nn.Sequential(nn.Linear(k, n, bias=False)).to("cuda", torch.bfloat16)
        model = convert(holder, rec)
        seconds[name] = time_fwd_bwd(lambda m=model: m(x).backward(grad), args.iters)
    flops = 6 * args.tokens * k * n  # forward + two backward matmuls
    emit(
        part="linear",
        M=args.tokens,
        K=k,
        N=n,
        recipe=recipe,
        bf16_ms=round(seconds["bf16"] * 1e3, 3),
        float8_ms=round(seconds["float8"] * 1e3, 3),
        bf16_tflops=round(flops / seconds["bf16"] / 1e12, 1),
        float8_tflops=round(flops / seconds["float8"] / 1e12, 1),
        speedup=round(seconds["bf16"] / seconds["float8"], 3),
    )


def bench_model(recipe: str, args) -> None:
    batch = max(1, args.tokens // args.seq_len)
    tokens = torch.randint(args.vocab, (batch, args.seq_len), device="cuda")
    seconds = {}
    for name, rec in (("bf16", None), ("float8", recipe)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = SmallLM(args.vocab, args.dim, args.layers, args.dim // 128, 4 * args.dim)
        compiled = convert(model, rec)  # converts the meta model in place, then compiles it
        model.to_empty(device="cuda")
        for p in model.parameters():
            nn.init.normal_(p, std=0.02)
        model.to(torch.bfloat16)

        def step(m=compiled):
            logits = m(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()

        seconds[name] = time_fwd_bwd(step, args.iters)
        del model, compiled
    n_tokens = batch * args.seq_len
    emit(
        part="model",
        dim=args.dim,
        layers=args.layers,
        vocab=args.vocab,
        tokens=n_tokens,
        recipe=recipe,
        bf16_tokens_per_s=round(n_tokens / seconds["bf16"]),
        float8_tokens_per_s=round(n_tokens / seconds["float8"]),
        speedup=round(seconds["bf16"] / seconds["float8"], 3),
    )


def main(args: argparse.Namespace) -> None:

    if not torch.cuda.is_available():
        emit(
            device="cpu",
            skipped=True,
            note="Float8 has no speed benefit on CPU: torch's CPU _scaled_mm "
            "is a reference kernel, far slower than bf16 matmul; run this on a GPU with capability >= 8.9",
        )
        return
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        emit(
            device=torch.cuda.get_device_name(),
            skipped=True,
            note=f"capability {capability[0]}.{capability[1]} has no Float8 matmuls (needs 8.9+)",
        )
        return
    emit(device=torch.cuda.get_device_name(), torch=torch.__version__)
    for recipe in args.recipes.split(","):
        for k, n in LLAMA_8B_LINEARS:
            bench_linear(k, n, recipe, args)
        bench_model(recipe, args)


if __name__ == "__main__":
    main(ARGS)
