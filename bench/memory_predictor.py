"""The dry run's memory estimate against measurement, as JSON lines (one per layout and rank role).

    uv run python bench/memory_predictor.py [--layouts fsdp2,pp2] [--seq-len 1024]

Each layout of the debug model runs twice: simulated on fake tensors (what `titan-train
--dry-run` predicts), and for real on CPU gloo process groups with the same memory tracker and
the process's resident set. `error_pct` is (predicted - measured) / measured at the step's peak;
`rss_error_pct` the same against the operating system's count. The last line summarises.
"""

from __future__ import annotations

import argparse
import json
import time

from titan_core import load_config, plugins, resolve
from titan_trainer.config import JobConfig
from titan_trainer.dry_run_check import compare_layout

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "FSDP 2": (2, []),
    "HSDP 2x2": (
        4,
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    ),
    "FSDP 2 x TP 2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "PP 2 (1F1B)": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
    "CP 2": (
        2,
        [
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
    ),
    "FSDP 2, AC full": (2, ["--activation_checkpoint.mode", "full"]),
    "FSDP 2, AC selective op": (2, ["--activation_checkpoint.mode", "selective"]),
    "FSDP 2, Float8": (2, ["--model.converters", "quantize.linear.float8"]),
}


def layout_config(extra: list[str], seq_len: int, batch: int) -> JobConfig:
    return load_config(
        JobConfig,
        [
            "--model.flavor",
            "debugmodel",
            "--training.seq_len",
            str(seq_len),
            "--training.local_batch_size",
            str(batch),
            "--training.mixed_precision_param",
            "float32",
            "--activation_checkpoint.mode",
            "none",
            *extra,
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    errors, rss_errors = [], []
    for name in args.layouts.split(","):
        world, extra = LAYOUTS[name]
        start = time.perf_counter()
        for c in compare_layout(
            name, layout_config(extra, args.seq_len, args.batch_size), world, vocab
        ):
            row = c.row() | {"seconds": round(time.perf_counter() - start, 1)}
            print(json.dumps(row), flush=True)
            errors.append(abs(c.error))
            rss_errors.append(abs(c.rss_error))
    print(
        json.dumps(
            {
                "summary": "predicted vs measured step peak",
                "layouts": len(args.layouts.split(",")),
                "max_abs_error_pct": round(100 * max(errors), 2),
                "max_abs_rss_error_pct": round(100 * max(rss_errors), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
