"""Every GPU benchmark in one command, written to one JSON file.

    uv run nox -s bench-gpu                     # = uv run python bench/gpu.py
    uv run python bench/gpu.py --out results.json

On a machine with CUDA GPUs it runs, each in a process of its own:

1. `throughput`: the 1B flavor (Llama 3.2 1B shapes, Llama 3's vocabulary of 128256, random
   tokens), bfloat16, FSDP on one GPU, eager and compiled side by side (bench/throughput.py).
   Target: MFU >= 50% compiled on one H100.
2. `float8`: bfloat16 against Float8 on Llama 3.1 8B-shaped linear layers and a small
   transformer (bench/float8.py). Target: Float8 >= 1.3x bfloat16 on the 8B-shaped layers.
3. `async_tp`: with two GPUs or more, the 3B flavor with tensor parallel over every GPU,
   compiled, plain against asynchronous TP (torchrun, bench/throughput.py).
4. `ckpt`: synchronous save against async saves, `async` and `async_with_pinned_mem`, of a
   2 GB model's training state (bench/ckpt.py).

The file holds the machine (GPUs, torch, CUDA), every record each part printed, its command,
exit status and time, and whether each target was met. Without a CUDA GPU nothing is measured:
the command says so and exits with status 2. `--smoke` runs every part at toy sizes on
whatever device is here, to check that the commands work (the numbers mean nothing then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
NO_GPU_EXIT = 2


def parts_to_run(gpus: int, smoke: bool) -> dict[str, list[str]]:
    """Each part's command, by name."""
    py = [sys.executable, "-u"]
    if smoke:
        throughput = ["--flavors", "debugmodel", "--seq-len", "64", "--batch-size", "2",
                      "--steps", "2", "--warmup", "1", "--variants", "eager",
                      "--synthetic-vocab", "512", "--fsdp-one-device"]  # fmt: skip
        float8 = ["--tokens", "256", "--iters", "2", "--dim", "256", "--layers", "2"]
        ckpt = ["--mb", "8", "--saves", "1", "--interval", "2"]
    else:
        throughput = ["--flavors", "1B", "--synthetic-vocab", "128256", "--dtype", "bfloat16",
                      "--seq-len", "4096", "--batch-size", "4", "--steps", "10", "--warmup", "3",
                      "--fsdp-one-device", "--variants", "eager;--compile.enable"]  # fmt: skip
        float8 = []
        ckpt = ["--mb", "2048", "--saves", "3", "--interval", "5"]
    parts = {
        "throughput": [*py, str(BENCH / "throughput.py"), *throughput],
        "float8": [*py, str(BENCH / "float8.py"), *float8],
        "ckpt": [*py, str(BENCH / "ckpt.py"), *ckpt],
    }
    if gpus >= 2:
        parts["async_tp"] = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={gpus}", str(BENCH / "throughput.py"), "--flavors", "3B",
            "--synthetic-vocab", "128256", "--dtype", "bfloat16", "--seq-len", "4096",
            "--batch-size", "2", "--steps", "10", "--warmup", "3",
            "--variants", "sync_tp;--parallelism.enable_async_tensor_parallel",
            "--", "--compile.enable", "--parallelism.tensor_parallel_degree", str(gpus),
        ]  # fmt: skip
    return parts


def run_part(command: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    records = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):  # a line that only looks like JSON
                records.append(json.loads(line))
    out = {
        "command": command,
        "returncode": done.returncode,
        "seconds": round(time.perf_counter() - start, 1),
        "records": records,
    }
    if done.returncode:
        out["stderr_tail"] = done.stderr[-4000:]
    return out


def targets(results: dict) -> list[dict]:
    """Each target of the GPU benchmarks, with the value measured and whether it was met."""
    out = []
    compiled = [
        r
        for r in results.get("throughput", {}).get("records", [])
        if r.get("variant") == "--compile.enable"
    ]
    if compiled:
        mfu = compiled[0]["mfu_pct"]
        out.append({"target": "1B bf16 compiled MFU >= 50%", "value": mfu, "met": mfu >= 50.0})
    linears = [
        r["speedup"]
        for r in results.get("float8", {}).get("records", [])
        if r.get("part") == "linear"
    ]
    if linears:
        worst = min(linears)
        out.append(
            {
                "target": "Float8 >= 1.3x bf16 on every 8B-shaped linear (worst shape)",
                "value": worst,
                "met": worst >= 1.3,
            }
        )
    return out


def machine() -> dict:
    info = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-gpu.json", help="the JSON file to write")
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes on any device: checks the commands only"
    )
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.smoke:
        print(
            f"bench-gpu: no CUDA GPU on this machine (torch {torch.__version__} sees none), so"
            " nothing was measured and no file was written\n"
            "           run it on a machine with an NVIDIA GPU; the CPU benchmarks are"
            " `uv run nox -s bench`",
            file=sys.stderr,
        )
        return NO_GPU_EXIT
    results = {}
    for name, command in parts_to_run(gpus, args.smoke).items():
        print(f"bench-gpu: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_part(command)
        status = "ok" if results[name]["returncode"] == 0 else "FAILED"
        print(f"bench-gpu: {name} {status} in {results[name]['seconds']} s", file=sys.stderr)
    report = {
        "machine": machine(),
        "smoke": args.smoke,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parts": results,
        "targets": targets(results),
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    for target in report["targets"]:
        print(f"bench-gpu: {target}", file=sys.stderr)
    print(f"bench-gpu: wrote {args.out}", file=sys.stderr)
    return 1 if any(r["returncode"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
