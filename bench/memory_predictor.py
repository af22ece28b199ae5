"""The dry run's memory estimate against measurement, as JSON lines (one per layout and rank role).

    uv run python bench/memory_predictor.py [--layouts "FSDP 2,PP 2 (1F1B)"] [--seq-len 1024]
    uv run python bench/memory_predictor.py --layouts "FSDP 2 compiled" --inductor

Each layout of the debug model runs twice: simulated on fake tensors (what `titan-train
--dry-run` predicts, for the CPU's kernels), and for real on CPU gloo process groups with the
same memory tracker and the process's resident set. `error_pct` is (predicted - measured) /
measured at the step's peak; `rss_error_pct` the same against the operating system's count.
Compiled layouts run the simulation's graphs for real (inductor's fusions left out of the
tracker's count only), so their resident set is no reference; `--inductor` runs them once
more compiled by inductor for real (minutes of C++ compilation per process) and reports that
resident set (`compiled_rss_error_pct`). The last line summarises.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--layouts", default=None, help="comma-separated layout names (default: every layout)"
    )
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--inductor",
        action="store_true",
        help="compiled layouts: also the resident set of a real inductor compile",
    )
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

from titan_core import plugins, resolve
from titan_trainer.dry_run.accuracy import LAYOUTS, compare_layout, layout_config


def main(args: argparse.Namespace) -> None:
    args.layouts = args.layouts or ",".join(LAYOUTS)
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    errors, rss_errors, compiled_errors = [], [], []
    for name in args.layouts.split(","):
        world, extra = LAYOUTS[name]
        start = time.perf_counter()
        config = layout_config(extra, args.seq_len, args.batch_size)
        for c in compare_layout(name, config, world, vocab, real_compile=args.inductor):
            row = c.row() | {"seconds": round(time.perf_counter() - start, 1)}
            print(json.dumps(row), flush=True)
            errors.append(abs(c.error))
            if not config.compile.enable:
                rss_errors.append(abs(c.rss_error))
            if c.compiled_rss is not None:
                compiled_errors.append(abs(row["compiled_rss_error_pct"]) / 100)
    summary = {
        "summary": "predicted vs measured step peak",
        "layouts": len(args.layouts.split(",")),
        "max_abs_error_pct": round(100 * max(errors), 2),
    }
    if rss_errors:  # layouts that are not compiled
        summary["max_abs_rss_error_pct"] = round(100 * max(rss_errors), 2)
    if compiled_errors:
        summary["max_abs_compiled_rss_error_pct"] = round(100 * max(compiled_errors), 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(ARGS)
