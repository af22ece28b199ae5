"""Every GPU benchmark in one command, each part's records appended to one JSON-lines file as
the part ends.

    uv run nox -s bench-gpu                     # = uv run python bench/gpu.py
    uv run python bench/gpu.py --out results.jsonl

On a machine with a CUDA GPU it runs, each in a process of its own (and each throughput
variant in its own process, so that only one model is ever alive on the GPU):

1. `throughput_eager`, `throughput_eager_attention_auto`, `throughput_compiled`: the 1B
   flavor (Llama 3.2 1B shapes, Llama 3's vocabulary of 128256, random tokens), bfloat16, FSDP
   on one GPU, eager, eager with the attention kernel timed per shape (`[model]
   attention_backend = "auto"`, against torch's own pick in the eager part) and compiled
   (bench/throughput.py). Target: MFU >= 50% compiled on one H100.
2. `float8`: bfloat16 against Float8 on Llama 3.1 8B-shaped linear layers and a small
   transformer (bench/float8.py). Target: Float8 >= 1.3x bfloat16 on the 8B-shaped layers.
3. `async_tp`: with two GPUs or more, the 3B flavor with tensor parallel over every GPU,
   compiled, plain against asynchronous TP (torchrun, bench/throughput.py).
4. `ckpt`: synchronous save against async saves, `async` and `async_with_pinned_mem`, of a
   1 GB model's training state (bench/ckpt.py).

Sized for one 80 GB GPU and short: before a throughput part starts, the trainer's dry run
predicts its peak memory (`titan_trainer.dry_run.simulate`, fake tensors, nothing allocated);
a batch that does not fit under `--fit-fraction` of the GPU's memory is halved until one does,
and a part that fits at no batch is not run (each is said on stderr and recorded). Every part
has a time limit (`PART_SECONDS`, 9 minutes in all on one H100 by the figures in the README);
a part past it is stopped and recorded as timed out, and the next one runs.

The file (JSON lines) starts with the machine (GPUs, torch, CUDA); then, as each part ends,
one line with its command, sizing, exit status, time and every record it printed; at the end
one line with whether each target was met. A run that is stopped keeps every finished part.
Without a CUDA GPU nothing is measured: the command says so and exits with status 2.
`--smoke` runs every part at toy sizes on whatever device is here, to check the commands (the
numbers mean nothing then).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-gpu.jsonl", help="the JSON-lines file to write")
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes on any device: checks the commands only"
    )
    parser.add_argument(
        "--memory-gib", type=float, default=None, help="the GPU's memory (default: CUDA's count)"
    )
    parser.add_argument(
        "--fit-fraction",
        type=float,
        default=0.85,
        help="a part runs when the dry run predicts at most this fraction of the memory",
    )
    parser.add_argument("--only", default=None, help="run only these parts (comma-separated names)")
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch

BENCH = Path(__file__).resolve().parent
NO_GPU_EXIT = 2
GiB = 2**30

# Seconds each part may take on one H100 (about 540 in all): the 1B eager part is ~20 s of
# set-up and a few seconds of steps; compiled adds ~1-2 minutes of compilation; Float8
# compiles two recipes over four shapes and a small transformer; the checkpoint part writes
# about 12 GB three ways.
PART_SECONDS = {
    "throughput_eager": 75,
    "throughput_eager_attention_auto": 60,
    "throughput_compiled": 150,
    "float8": 150,
    "ckpt": 90,
    "async_tp": 180,
}
SMOKE_SECONDS = 600


def throughput_flags(smoke: bool, batch: int) -> list[str]:
    if smoke:
        return ["--flavors", "debugmodel", "--seq-len", "16", "--batch-size", str(batch),
                "--steps", "2", "--warmup", "0", "--synthetic-vocab", "512",
                "--fsdp-one-device"]  # fmt: skip
    return ["--flavors", "1B", "--synthetic-vocab", "128256", "--dtype", "bfloat16",
            "--seq-len", "4096", "--batch-size", str(batch), "--steps", "6", "--warmup", "2",
            "--fsdp-one-device"]  # fmt: skip


def dry_run_args(smoke: bool, batch: int) -> tuple[list[str], int]:
    """Trainer flags describing what a throughput part builds, and its vocabulary."""
    flavor, seq, dtype, vocab = ("debugmodel", 16, "float32", 512) if smoke else (
        "1B", 4096, "bfloat16", 128256
    )  # fmt: skip
    flags = ["--model.flavor", flavor, "--training.seq_len", str(seq),
             "--training.local_batch_size", str(batch), "--activation_checkpoint.mode", "none",
             "--training.mixed_precision_param", dtype]  # fmt: skip
    return flags, vocab


def predicted_peak_gib(flags: list[str], vocab: int) -> float:
    """The dry run's peak memory of one rank of a one-process job with these flags."""
    from titan_core import load_config
    from titan_trainer.config import JobConfig
    from titan_trainer.dry_run import simulate

    return simulate(load_config(JobConfig, flags), 1, vocab).worst.peak / GiB


def size_batch(smoke: bool, budget_gib: float, say) -> tuple[int | None, list[dict]]:
    """The largest batch (4, 2, 1) whose predicted peak fits under `budget_gib`; None when
    none does. Returns it with what each prediction was."""
    tried = []
    for batch in (2,) if smoke else (4, 2, 1):
        flags, vocab = dry_run_args(smoke, batch)
        peak = predicted_peak_gib(flags, vocab)
        fits = peak <= budget_gib
        tried.append({"batch": batch, "predicted_peak_gib": round(peak, 2), "fits": fits})
        say(
            f"throughput batch {batch}: the dry run predicts {peak:.3g} GiB, budget"
            f" {budget_gib:.3g} GiB: {'fits' if fits else 'does not fit'}"
        )
        if fits:
            return batch, tried
    return None, tried


def parts_to_run(gpus: int, smoke: bool, batch: int | None) -> dict[str, list[str]]:
    """Each part's command, by name (throughput parts only when a batch fits)."""
    py = [sys.executable, "-u"]
    if smoke:
        float8 = ["--tokens", "256", "--iters", "2", "--dim", "256", "--layers", "2"]
        ckpt = ["--mb", "8", "--saves", "1", "--interval", "2"]
    else:
        float8 = ["--iters", "10", "--layers", "2"]
        ckpt = ["--mb", "1024", "--saves", "2", "--interval", "4"]
    parts = {}
    if batch is not None:
        throughput = [*py, str(BENCH / "throughput.py"), *throughput_flags(smoke, batch)]
        parts["throughput_eager"] = [*throughput, "--variants", "eager"]
        parts["throughput_eager_attention_auto"] = [
            *throughput, "--variants", "attention_auto", "--", "--model.attention_backend", "auto"
        ]  # fmt: skip
        # Smoke: the compile path without the minutes a C++ compiler takes on a CPU.
        compiled = ["--compile.enable", *(["--compile.backend", "aot_eager"] if smoke else [])]
        parts["throughput_compiled"] = [*throughput, "--variants", "compiled", "--", *compiled]
    parts["float8"] = [*py, str(BENCH / "float8.py"), *float8]
    parts["ckpt"] = [*py, str(BENCH / "ckpt.py"), *ckpt]
    if gpus >= 2:
        parts["async_tp"] = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={gpus}", str(BENCH / "throughput.py"), "--flavors", "3B",
            "--synthetic-vocab", "128256", "--dtype", "bfloat16", "--seq-len", "4096",
            "--batch-size", "2", "--steps", "6", "--warmup", "2",
            "--variants", "sync_tp;--parallelism.enable_async_tensor_parallel",
            "--", "--compile.enable", "--parallelism.tensor_parallel_degree", str(gpus),
        ]  # fmt: skip
    return parts


def run_part(command: list[str], seconds: float) -> dict:
    """Run one part in its own process (its own session, so that a timeout stops all of it)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        stdout, stderr = proc.communicate()
    records = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):  # a line that only looks like JSON
                records.append(json.loads(line))
    out = {
        "command": command,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.perf_counter() - start, 1),
        "records": records,
    }
    if proc.returncode:
        out["stderr_tail"] = stderr[-4000:]
    return out


def targets(results: dict) -> list[dict]:
    """Each target of the GPU benchmarks, with the value measured and whether it was met."""
    out = []
    compiled = results.get("throughput_compiled", {}).get("records", [])
    eager = results.get("throughput_eager", {}).get("records", [])
    if compiled:
        mfu = compiled[0]["mfu_pct"]
        out.append({"target": "1B bf16 compiled MFU >= 50%", "value": mfu, "met": mfu >= 50.0})
    auto = results.get("throughput_eager_attention_auto", {}).get("records", [])
    if auto and eager:  # one after the other on the same GPU; `attention`: the kernel picked
        ratio = round(auto[0]["step_s"] / eager[0]["step_s"], 3)
        measure = f"1B eager step time, attention_backend auto ({auto[0]['attention']}) / default"
        out.append({"measure": measure, "value": ratio})
    if compiled and eager:  # measured one after the other in this run, on the same GPU
        ratio = round(compiled[0]["step_s"] / eager[0]["step_s"], 3)
        out.append({"measure": "1B compiled step time / eager step time", "value": ratio})
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
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def device_gib(override: float | None) -> float:
    """Memory of the GPU the parts run on (GiB): `--memory-gib`, else CUDA's own count; 80
    GB's worth on a machine without one (--smoke)."""
    if override is not None:
        return override
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return 79.2


def append(path: Path, line: dict) -> None:
    """One JSON line, on disk before the next part starts."""
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(args: argparse.Namespace) -> int:
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

    def say(text: str) -> None:
        print(f"bench-gpu: {text}", file=sys.stderr, flush=True)

    out = Path(args.out)
    out.write_text("")
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    append(out, {"kind": "machine", "smoke": args.smoke, "when": when, **machine()})
    budget = args.fit_fraction * device_gib(args.memory_gib)
    batch, tried = size_batch(args.smoke, budget, say)
    if batch is None:
        say(f"the throughput parts fit at no batch under {budget:.3g} GiB: not run")
        append(out, {"kind": "part", "part": "throughput", "not_run": "does not fit", "sizing": tried})  # fmt: skip
    results = {}
    parts = parts_to_run(gpus, args.smoke, batch)
    if args.only:
        parts = {n: c for n, c in parts.items() if n in args.only.split(",")}
    for name, command in parts.items():
        seconds = SMOKE_SECONDS if args.smoke else PART_SECONDS[name]
        say(f"{name} ... (at most {seconds} s)")
        results[name] = run_part(command, seconds)
        line = {"kind": "part", "part": name, **results[name]}
        if name.startswith("throughput"):
            line["sizing"] = tried
        append(out, line)
        status = "ok" if results[name]["returncode"] == 0 else "FAILED"
        if results[name]["timed_out"]:
            status = f"stopped after its {seconds} s"
        say(f"{name} {status} in {results[name]['seconds']} s")
    report = targets(results)
    append(out, {"kind": "targets", "targets": report})
    for target in report:
        say(str(target))
    say(f"wrote {out}")
    failed = batch is None or any(r["returncode"] for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
