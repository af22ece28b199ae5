"""`titan-compare`: line up the TensorBoard scalars of two or more runs by step.

    titan-compare outputs/fsdp outputs/fsdp_tp --metric loss --tolerance 1e-4

prints, for each metric and each run against the first, the difference at the first and the
last shared step and the largest one (with its step), draws the curves and their differences to
a PNG (`--plot`, needs matplotlib; by default compare.png in the first run's folder), and with
`--tolerance` exits 1 when a checked metric (those named with `--metric`, else loss) differs by
more than that at any shared step: a CI check that two layouts train alike. Exit 2: a folder
holds no scalars, or the runs share no step.

A folder is a run's dump folder (or its TensorBoard folder): the newest run written there, with
every resume of it. When another run used the same folder before, a note says which run is read;
give that run's own folder (`<dump>/tb/<run id>`) to compare an older one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from titan_trainer.compare_plot import write_comparison_plot
from titan_trainer.plots import Series, matplotlib_missing, read_event_folders, runs_under
from titan_trainer.tools import run_tool, tool_parser


class CompareError(Exception):
    pass


def load_runs(folders: Sequence[str]) -> dict[str, Series]:
    runs = {}
    for folder in folders:
        found = runs_under(folder)
        if len(found) > 1:  # unrelated runs in one dump folder: never merged
            others = ", ".join(path for path, _ in found[:-1])
            print(
                f"titan-compare: {folder} holds {len(found)} runs; reading the newest,"
                f" {found[-1][0]} (the others: {others})",
                file=sys.stderr,
            )
        series = read_event_folders(found[-1][1]) if found else {}
        if not series:
            raise CompareError(
                f"{folder} holds no TensorBoard scalars; give a run's dump folder (runs write "
                "them with [metrics] enable_tensorboard = true, the default)"
            )
        runs[folder] = series
    return runs


def differences(runs: dict[str, Series], metric: str, reference: str, relative: bool) -> list[dict]:
    """For each run other than `reference`: its shared steps and the differences there."""
    rows = []
    base = runs[reference][metric]
    for name, series in runs.items():
        if name == reference:
            continue
        steps = sorted(set(series[metric]) & set(base))
        diffs = []
        for step in steps:
            diff = series[metric][step] - base[step]
            if relative:
                diff /= max(abs(base[step]), 1e-12)
            diffs.append(diff)
        worst = max(range(len(diffs)), key=lambda i: abs(diffs[i])) if diffs else None
        rows.append(
            {
                "run": name,
                "steps": steps,
                "first": diffs[0] if diffs else math.nan,
                "last": diffs[-1] if diffs else math.nan,
                "max": diffs[worst] if diffs else math.nan,
                "max_step": steps[worst] if diffs else None,
            }
        )
    return rows


def format_table(table: dict[str, list[dict]], reference: str, relative: bool) -> str:
    kind = "relative difference" if relative else "difference"
    lines = [
        f"{kind} from {reference}, at the steps both runs logged",
        f"{'metric':<16} {'run':<28} {'steps':>11} {'first':>11} {'last':>11} {'max':>11} {'at step':>8}",
    ]
    for metric, rows in table.items():
        for row in rows:
            steps = row["steps"]
            span = f"{steps[0]}-{steps[-1]} ({len(steps)})" if steps else "none"
            lines.append(
                f"{metric:<16} {_short(row['run'], 28):<28} {span:>11} {row['first']:>+11.3e} "
                f"{row['last']:>+11.3e} {row['max']:>+11.3e} {str(row['max_step'] or '-'):>8}"
            )
    return "\n".join(lines)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def compare(args: argparse.Namespace) -> int:
    runs = load_runs(args.runs)
    reference = args.runs[0]
    shared = [m for m in runs[reference] if all(m in s for s in runs.values())]
    metrics = args.metric or sorted(shared, key=lambda m: (m != "loss", m))
    missing = [m for m in metrics if m not in shared]
    if missing:
        lacking = {m: [r for r, s in runs.items() if m not in s] for m in missing}
        raise CompareError(
            "; ".join(f"{m} is not logged by {', '.join(r)}" for m, r in lacking.items())
            + f"\nmetrics every run logged: {', '.join(sorted(shared)) or 'none'}"
        )
    table = {m: differences(runs, m, reference, args.relative) for m in metrics}
    if not any(row["steps"] for rows in table.values() for row in rows):
        raise CompareError(
            "the runs share no logged step; log at the same steps (metrics.log_freq)"
        )
    print(format_table(table, reference, args.relative))
    if args.plot is None:  # beside the runs, not wherever the command was typed
        args.plot = os.path.join(reference, "compare.png")
    if args.plot:
        why_not = matplotlib_missing()
        if why_not:
            print(f"titan-compare: no plot: {why_not}", file=sys.stderr)
        else:
            drawn = write_comparison_plot(runs, metrics, args.plot, reference)
            skipped = f" ({', '.join(drawn.left_out)}: 0 throughout, not drawn)"
            print(f"plot: {args.plot}{skipped if drawn.left_out else ''}")
    if args.tolerance is None:
        return 0
    checked = args.metric or ["loss"]
    over = [
        (metric, row)
        for metric in checked
        for row in table[metric]
        if not abs(row["max"]) <= args.tolerance  # NaN fails too
    ]
    for metric, row in over:
        print(
            f"titan-compare: {metric} of {row['run']} differs from {reference} by "
            f"{row['max']:+.3e} at step {row['max_step']}, above the tolerance {args.tolerance:g}",
            file=sys.stderr,
        )
    if not over:
        print(f"within tolerance {args.tolerance:g}: {', '.join(checked)}")
    return 1 if over else 0


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("titan-compare", __doc__)
    parser.add_argument(
        "runs", nargs="+", help="run folders (job.dump_folder); the first is the reference"
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        help="a metric to compare (repeatable; default: every metric all runs logged)",
    )
    parser.add_argument(
        "--plot",
        "--out",
        default=None,
        help="PNG to draw the curves and differences to (default: compare.png in the first"
        " run's folder; '' for none)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="exit 1 if a checked metric (--metric, else loss) differs by more than this",
    )
    parser.add_argument(
        "--relative",
        action="store_true",
        help="differences relative to the reference's value instead of absolute",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.runs) < 2:
        print("titan-compare: error: give two or more run folders", file=sys.stderr)
        return 2
    return run_tool("titan-compare", compare, args, (CompareError, FileNotFoundError), 2)


if __name__ == "__main__":
    sys.exit(main())
