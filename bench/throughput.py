"""Training throughput of the trainer's own step loop, with MFU against a peak measured in the
same run, as JSON lines.

    uv run python bench/throughput.py [--steps 8] [--flavors debugmodel,100M] [--seq-len 512]

For each flavor it builds the model exactly as titan-train does (plugins, meta device,
parallelize, init), runs warm-up steps, then times steps split into data loading,
forward+backward, optimizer (clip + step) and the rest. The matmul peak for the compute dtype
is measured in the same process just before, so MFU is a ratio of two numbers taken side by
side on the same (possibly noisy) machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titan_core import (
    init_distributed,
    load_config,
    measure_matmul_flops,
    plugins,
    resolve,
    resolve_device_type,
)
from titan_core.distributed import destroy_distributed
from titan_trainer.checks import parallel_dims_for
from titan_trainer.config import JobConfig
from titan_trainer.optimizer import build_optimizer
from titan_trainer.parallel import build_parallel_runtime
from titan_trainer.precision import compute_dtype
from titan_trainer.train import build_model, cross_entropy_loss


def bench_flavor(flavor: str, args, device, peak: float, dtype: torch.dtype) -> dict:
    cfg = load_config(
        JobConfig,
        [
            "--model.flavor",
            flavor,
            "--training.seq_len",
            str(args.seq_len),
            "--training.local_batch_size",
            str(args.batch_size),
            "--training.mixed_precision_param",
            "auto" if dtype == torch.bfloat16 else "float32",
            "--activation_checkpoint.mode",
            "none",
            *(["--compile.enable"] if args.compile else []),
        ],
    )
    dims = parallel_dims_for(cfg, 1)
    dims.build_mesh(device.type)
    data = resolve(plugins.DATA, cfg.training.data_plugin)
    tokenizer = data.build_tokenizer(cfg.model.tokenizer_path)
    loader = data.build_dataloader(
        dataset=cfg.training.dataset,
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=cfg.training.seq_len,
        batch_size=cfg.training.local_batch_size,
    )
    runtime = build_parallel_runtime(cfg, dims, device, dtype, 0, cross_entropy_loss)
    parts = build_model(cfg, runtime, tokenizer.vocab_size, [])
    runtime.materialize(parts)
    runtime.init_weights(parts)
    optimizer = build_optimizer(parts, cfg.optimizer)
    batches = iter(loader)
    n_params = sum(p.numel() for part in parts for p in part.parameters())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {"data": 0.0, "fwd_bwd": 0.0, "optim": 0.0, "total": 0.0}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        inputs, labels = (t.to(device) for t in next(batches))
        sync()
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        runtime.forward_backward(parts, inputs, labels, scale=1.0)
        sync()
        t2 = time.perf_counter()
        runtime.clip_grad_norm(parts, cfg.training.max_norm)
        optimizer.step()
        sync()
        t3 = time.perf_counter()
        if step >= args.warmup:
            times["data"] += t1 - t0
            times["fwd_bwd"] += t2 - t1
            times["optim"] += t3 - t2
            times["total"] += t3 - t0
    tokens = args.steps * args.batch_size * args.seq_len
    tps = tokens / times["total"]
    flops = runtime.flops_per_token * tps
    return {
        "bench": "throughput",
        "flavor": flavor,
        "params": n_params,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "compile": args.compile,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "tokens_per_s": round(tps, 1),
        "tflops": round(flops / 1e12, 4),
        "peak_tflops_measured": round(peak / 1e12, 4),
        "mfu_pct": round(100 * flops / peak, 2),
        "step_s": round(times["total"] / args.steps, 4),
        "fwd_bwd_share": round(times["fwd_bwd"] / times["total"], 4),
        "optim_share": round(times["optim"] / times["total"], 4),
        "outside_share": round(1 - (times["fwd_bwd"] + times["optim"]) / times["total"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavors", default="debugmodel,100M")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    info = init_distributed(resolve_device_type("auto"))
    try:
        dtype = compute_dtype("auto", info.device)
        peak = measure_matmul_flops(
            info.device, dtype, size=2048 if info.device.type == "cpu" else 8192, min_seconds=1.0
        )
        print(
            json.dumps(
                {
                    "bench": "matmul_peak",
                    "device": str(info.device),
                    "dtype": str(dtype).removeprefix("torch."),
                    "tflops": round(peak / 1e12, 4),
                }
            ),
            flush=True,
        )
        for flavor in args.flavors.split(","):
            print(json.dumps(bench_flavor(flavor, args, info.device, peak, dtype)), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
