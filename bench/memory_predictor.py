"""The dry run's memory estimate against measurement, as JSON lines (one per layout and rank role).

    uv run python bench/memory_predictor.py [--layouts "FSDP 2,PP 2 (1F1B)"] [--seq-len 1024]

Each layout of the debug model runs twice: simulated on fake tensors (what `titan-train
--dry-run` predicts), and for real on CPU gloo process groups with the same memory tracker and
the process's resident set. `error_pct` is (predicted - measured) / measured at the step's peak;
`rss_error_pct` the same against the operating system's count. The last line summarises.
"""

from __future__ import annotations

import argparse
import json
import time

from titan_core import plugins, resolve
from titan_trainer.dry_run_check import LAYOUTS, compare_layout, layout_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layout names")
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
