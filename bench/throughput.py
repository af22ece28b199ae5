"""Training throughput of the trainer's own step, with MFU and a breakdown of each step, as JSON
lines.

    uv run python bench/throughput.py                                    # debug model and 104M, 8 x 2048
    uv run python bench/throughput.py --variants "eager;--compile.enable"  # side by side: ratios
    uv run python bench/throughput.py --flavors 1B --synthetic-vocab 128256 --fsdp-one-device \
        -- --compile.enable --training.mixed_precision_param bfloat16   # a GPU

Each variant (a list of trainer flags, `;` between variants) builds the model the way
`titan-train` does: the trainer's config, model build (meta device, converters, TP -> AC ->
compile -> FSDP), initialisation, loader, optimizer, LR schedule and non-finite guard. Then
the steps of every variant are interleaved round-robin, so a noisy machine slows them alike.
Each step is the trainer's own (`titan_trainer.step.train_step`, between the LR schedule's
`apply` and `step` as the train loop runs it), timed in parts at the points the step marks:

- `data`: the next batch from the loader (and its copy to the device);
- `forward`: the model and the loss; `backward`: the loss's backward;
- `optimizer`: gradient clipping, the non-finite check, the optimizer and LR-schedule steps;
- `logging`: at the trainer's logging steps (`metrics.log_freq`), reading the loss and
  gradient norm back and writing the metric line, as the trainer does.

On a GPU each part ends with a synchronisation, so that its time is its own; `host_syncs` counts
the device-to-host waits the step itself makes (the guard reads the loss and norm back only at
logging steps with the fused optimizer; every step with the others). MFU is taken against the
peak the trainer uses (datasheet for known GPUs; on a CPU the best matmul measured on this
machine, see titan_core.peak_flops). `drift` compares the median step time of the last quarter
of the timed steps with the first quarter's (1.0: flat).

Flags after `--` apply to every variant. `--synthetic-vocab N` trains on random tokens of a
vocabulary of N (a GPU run of the 1B flavor at Llama 3's 128256 without the tokenizer file);
`--fsdp-one-device` wraps the model in FSDP on a one-device mesh (bf16 parameters instead of
autocast, as a multi-GPU job computes).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flavors", default="debugmodel,100M")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "auto"],
        help="training.mixed_precision_param (auto: bfloat16 where the device computes it)",
    )
    parser.add_argument(
        "--variants",
        default="default",
        help="trainer flags per variant, ';' between variants; a variant with no flag is the"
        " trainer's default path (its name may be a word: 'eager;--compile.enable')",
    )
    parser.add_argument("--synthetic-vocab", type=int, default=0)
    parser.add_argument("--fsdp-one-device", action="store_true")
    parser.add_argument("common", nargs="*", help="trainer flags for every variant (after --)")
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch

from titan_core import Progress, init_distributed, load_config, peak_flops, resolve_device_type
from titan_core.distributed import destroy_distributed
from titan_trainer.attention import apply_attention_backend
from titan_trainer.config import JobConfig
from titan_trainer.guards import StepGuard
from titan_trainer.lr_schedule import build_lr_scheduler
from titan_trainer.metrics import StepTimer, format_line
from titan_trainer.optimizer import build_optimizer, current_lr
from titan_trainer.step import train_step
from titan_trainer.train import (
    build_converters,
    build_loader,
    build_model,
    build_parallel_runtime,
    cross_entropy_loss,
    set_up_layout,
)

PARTS = ("data", "forward", "backward", "optimizer", "logging")
log = logging.getLogger("bench.throughput")


@dataclass
class Variant:
    name: str
    flags: list[str]
    config: JobConfig = None
    step: callable = None
    flops_per_token: float = 0.0
    peak: float = 0.0
    dtype: torch.dtype = torch.float32
    params: int = 0
    times: list[dict[str, float]] = field(default_factory=list)
    host_syncs: int = 0
    attention: str = "default"


def build_variant(variant: Variant, args, info, dump: str) -> None:
    """The trainer's pieces for this variant, and a function that runs one timed step."""
    flags = [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch_size), "--training.steps",
        str(args.warmup + args.steps), "--activation_checkpoint.mode", "none",
        "--lr_scheduler.warmup_steps", "0",  # a few steps: the rate does not change the time
        "--training.mixed_precision_param", args.dtype, "--job.dump_folder", dump,
        *args.common, *variant.flags,
    ]  # fmt: skip
    config = variant.config = load_config(JobConfig, flags)
    dims, dtype, seed = set_up_layout(config, info)
    variant.dtype = dtype
    runtime = build_parallel_runtime(config, dims, info.device, dtype, seed, cross_entropy_loss)
    data = None
    if args.synthetic_vocab:
        vocab = args.synthetic_vocab
    else:
        from titan_core import plugins, resolve

        data = resolve(plugins.DATA, config.training.data_plugin)
        tokenizer = data.build_tokenizer(config.model.tokenizer_path)
        vocab = tokenizer.vocab_size
    parts = build_model(config, runtime, vocab, build_converters(config, dims))
    # [model] attention_backend, as the trainer applies it: timed or checked on the device.
    choice = apply_attention_backend(config, parts, dims, info.device, dtype)
    variant.attention = "default" if choice is None else choice.name
    if args.fsdp_one_device:
        apply_fsdp_one_device(parts, info.device, dtype, runtime)
    runtime.materialize(parts)
    runtime.init_weights(parts)
    variant.params = sum(p.numel() for part in parts for p in part.parameters())
    variant.flops_per_token = runtime.flops_per_token
    variant.peak = measured_peak(info.device, dtype, config.metrics.peak_tflops).flops
    optimizer = build_optimizer(
        parts, config.optimizer, total_steps=config.training.steps, dims=dims
    )
    scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    guard = StepGuard(optimizer, config.training.max_nonfinite_in_a_row)
    if data is not None:
        batches = iter(build_loader(config, data, tokenizer, dims))
    else:
        batches = synthetic_batches(args.batch_size, args.seq_len, vocab)
    device = info.device
    accum = 1  # one microbatch per step: the batch is the local batch
    timer = StepTimer()  # the trainer's data-time counter (the bench times each part itself)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(number: int) -> dict[str, float]:
        t = {"start": time.perf_counter()}

        def mark(phase: str) -> None:  # the end of each part of the trainer's step
            sync()
            t[phase] = time.perf_counter()

        scheduler.apply()
        train_step(
            runtime, parts, optimizer, batches, accum, timer, config, guard, number, mark=mark
        )
        scheduler.step()
        mark("optimizer")  # clipping, the non-finite check, the optimizer and schedule steps
        if number % config.metrics.log_freq == 0:
            rows = guard.read()  # the trainer's one read-back per logged step
            line = format_line(number, _metrics(rows[-1], optimizer))
            log.debug(line)
        t["logging"] = time.perf_counter()
        stamps = [t["start"], *(t[p] for p in PARTS)]
        return {p: b - a for p, a, b in zip(PARTS, stamps, stamps[1:])}

    variant.step = step
    variant.host_syncs = 0 if guard.on_device else 1  # per step, besides the logging read


@functools.cache
def measured_peak(device: torch.device, dtype: torch.dtype, override_tflops: float | None):
    """The peak MFU is taken against, measured once per device and dtype (on a CPU, half a
    second of matmuls or more): every variant and flavor of a run shares one denominator, so
    their MFUs compare as their step times do."""
    return peak_flops(device, dtype, override_tflops=override_tflops)


def _metrics(row, optimizer) -> dict[str, float]:
    _, loss, grad_norm = row
    zero = dict.fromkeys(("tokens_per_s", "tflops", "mfu_pct", "mem_peak_gib", "step_time_s"), 0.0)
    return {"loss": loss, "grad_norm": grad_norm, "lr": current_lr(optimizer), **zero}


def apply_fsdp_one_device(parts, device: torch.device, dtype: torch.dtype, runtime) -> None:
    """FSDP over a mesh of one device: the parameters are gathered in `dtype` for compute and
    the gradients reduced in float32, with no autocast (what a multi-GPU job computes)."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_parallel import apply_fsdp

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    for part in parts:
        apply_fsdp(part, mesh, param_dtype=dtype, reduce_dtype=torch.float32)
    runtime.autocast = None


def synthetic_batches(batch: int, seq_len: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def summarize(variant: Variant, args, device: torch.device, baseline: float | None) -> dict:
    rows = variant.times
    totals = [sum(r.values()) for r in rows]
    step_s = statistics.median(totals)
    tokens = args.batch_size * args.seq_len
    tps = tokens / step_s
    flops = tps * variant.flops_per_token
    quarter = max(1, len(totals) // 4)
    record = {
        "bench": "throughput",
        "flavor": args.flavor,
        "variant": variant.name,
        "params": variant.params,
        "device": str(device),
        "dtype": str(variant.dtype).removeprefix("torch."),
        "attention": variant.attention,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "steps_timed": len(rows),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tps, 1),
        "tflops": round(flops / 1e12, 4),
        "peak_tflops": round(variant.peak / 1e12, 4),
        "mfu_pct": round(100 * flops / variant.peak, 2),
        "breakdown_s": {p: round(statistics.median(r[p] for r in rows), 4) for p in PARTS},
        "host_syncs_per_step": variant.host_syncs + 1 / variant.config.metrics.log_freq,
        "drift": round(
            statistics.median(totals[-quarter:]) / statistics.median(totals[:quarter]), 3
        ),
    }
    if baseline is not None:
        record["step_time_over_first_variant"] = round(step_s / baseline, 3)
    return record


def variants_from(text: str) -> list[Variant]:
    out = []
    for part in text.split(";"):
        words = shlex.split(part)
        named = len(words) == 1 and not words[0].startswith("--")  # a word: no flags
        out.append(Variant(part.strip() or "default", [] if named else words))
    return out


def main(args: argparse.Namespace) -> None:
    info = init_distributed(resolve_device_type("auto"))
    try:
        for flavor in args.flavors.split(","):
            args.flavor = flavor
            variants = variants_from(args.variants)
            # Each round steps every variant once: said as it ends, with the time left (on
            # stderr; the results are the JSON lines on stdout).
            rounds = args.warmup + args.steps
            progress = Progress(f"throughput {flavor}", len(variants) + rounds)
            with tempfile.TemporaryDirectory() as dump:
                for variant in variants:
                    build_variant(variant, args, info, dump)
                    if info.rank == 0:
                        progress.done(f"variant {variant.name} built")
                gc.disable()  # as the trainer does during its steps
                for number in range(1, rounds + 1):
                    for variant in variants:
                        times = variant.step(number)
                        if number > args.warmup:
                            variant.times.append(times)
                    if info.rank == 0:
                        kind = "warm-up" if number <= args.warmup else "timed"
                        progress.done(f"step {number} of {rounds} ({kind}) of every variant")
                gc.enable()
            baseline = None
            for variant in variants:
                record = summarize(variant, args, info.device, baseline)
                baseline = baseline or record["step_s"]
                if info.rank == 0:
                    print(json.dumps(record), flush=True)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main(ARGS)
