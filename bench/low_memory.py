"""The memory-saving modes' loss and speed against mixed precision, as JSON lines: the debug
model trained from the same weights on the same batches of the embedded corpus under each
variant, through the trainer itself.

    uv run python bench/low_memory.py                     # 150 steps, seq 128, batch 8
    uv run python bench/low_memory.py --steps 20 --variants "mixed;bf16"

Variants (`--variants`, `;`-separated names):
- `mixed`: float32 parameters, gradients and AdamW moments, bfloat16 compute (the reference);
- `bf16`: `[training] dtype = "bfloat16"`, everything in bfloat16, no float32 master copy;
- `bf16_ranger21`: the same with Ranger21 and bfloat16 moments;
- `offload`: mixed precision with `[activation_checkpoint] cpu_offload` (on a CPU the same
  copies as on a GPU, no memory saved: its loss must equal `mixed`'s).

Each record gives the variant's loss at each `--every` steps, the mean loss over the last
`--tail` steps and its gap to `mixed`'s, the median step time and its ratio to `mixed`'s (the
runs follow each other, so a machine that gets busier in between skews the ratio). Memory is
`bench/memory_predictor.py`'s (the "bf16 params", "memory budget" and "offload" layouts). On a
CPU without bf16 instructions it runs, slowly.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "mixed": ["--training.dtype", "float32"],
    "bf16": ["--training.dtype", "bfloat16"],
    "bf16_ranger21": [
        *("--training.dtype", "bfloat16"),
        *("--optimizer.name", "Ranger21", "--optimizer.state_dtype", "bfloat16"),
    ],
    "offload": ["--training.dtype", "float32", "--activation_checkpoint.cpu_offload", "true"],
}

_STEP = re.compile(r"step\s+(\d+) \| loss ([\d.]+) .*\| ([\d.]+) s/step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--variants", default="mixed;bf16;bf16_ranger21;offload")
    parser.add_argument("--every", type=int, default=25, help="record the loss every N steps")
    parser.add_argument("--tail", type=int, default=20, help="mean loss over the last N steps")
    args = parser.parse_args(argv)
    unknown = [n for n in args.variants.split(";") if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

from titan_core import load_config
from titan_trainer.config import JobConfig
from titan_trainer.shipped import find_config_file
from titan_trainer.train import train


def run(variant: str, args: argparse.Namespace, folder: Path) -> dict:
    dump = folder / variant
    config = load_config(
        JobConfig,
        [
            *("--job.config_file", "debug_model", "--job.dump_folder", str(dump)),
            *("--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len)),
            *("--training.local_batch_size", str(args.batch_size)),
            *("--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1"),
            *("--lr_scheduler.warmup_steps", str(max(1, args.steps // 10))),
            *("--metrics.enable_tensorboard", "false", "--metrics.save_plots_folder", ""),
            *("--activation_checkpoint.mode", "none"),
            *VARIANTS[variant],
        ],
        find_config_file=find_config_file,
    )
    result = train(config)
    log = (dump / "logs" / "rank_0.log").read_text()
    times = [float(m.group(3)) for m in _STEP.finditer(log)][1:]  # the first step warms up
    losses = result.losses
    return {
        "variant": variant,
        "steps": len(losses),
        "tokens_per_step": args.seq_len * args.batch_size,
        "losses": {i + 1: round(x, 4) for i, x in enumerate(losses) if (i + 1) % args.every == 0},
        "tail_loss": round(statistics.fmean(losses[-args.tail :]), 4),
        "median_step_s": round(statistics.median(times), 4) if times else None,
    }


def main(args: argparse.Namespace) -> None:
    names = args.variants.split(";")
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            record = run(name, args, Path(tmp))
            if name == "mixed":
                reference = record
            if reference is not None and name != "mixed":
                record["tail_loss_gap"] = round(record["tail_loss"] - reference["tail_loss"], 4)
                if record["median_step_s"] and reference["median_step_s"]:
                    record["step_time_ratio"] = round(
                        record["median_step_s"] / reference["median_step_s"], 3
                    )
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(ARGS)
