"""The dry run's predicted step time against measurement on this CPU, as JSON lines.

    uv run python bench/step_time_cpu.py [--models debug,100M] [--layouts "FSDP 2,TP 2"]
    uv run python bench/step_time_cpu.py --record apps/trainer/tests/data/step_time_cpu.json \
        --out bench/results/step_time_cpu.jsonl

This machine is measured first (`titan_trainer.dry_run.cpu_system`: one thread's matmul peak
and step-shaped matmuls, attention kernel, memory bandwidth, per-operator overhead, a gloo
link's alpha-beta) and, for each layout, each of its processes' share of a core (fewer where
other work shares the machine); each real run also says the free cores it had. Each layout of each model
then runs twice: simulated on fake tensors and priced on that system (what `titan-train
--dry-run` predicts with `[dry_run] system = "cpu"`), and for real, `world_size` gloo
processes of one thread each timing whole training steps (the slowest rank's, median over the
steps). One line per layout (measured and predicted seconds, `error_pct` = (predicted -
measured) / measured), then one summary line per model: the largest error and whether the
layouts rank the same by both (pairwise order agreement and Kendall's tau); `--out` also writes
them to a file; `--record` keeps the traced work, the
system and the measurements (what `apps/trainer/tests/test_step_time_cpu.py` re-prices).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="debug,100M", help="comma-separated: debug, 100M")
    parser.add_argument("--layouts", default=None, help="comma-separated layout names")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default per model)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first")
    parser.add_argument("--record", default=None, help="JSON file to keep traces and timings in")
    parser.add_argument(
        "--out",
        default=None,
        help="also write the lines to this file (bench/results/step_time_cpu.jsonl is the"
        " recorded run's)",
    )
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import platform  # noqa: E402

import torch  # noqa: E402

from titan_core import plugins, resolve  # noqa: E402
from titan_trainer.dry_run.cpu_system import measured_cpu_system  # noqa: E402
from titan_trainer.dry_run.step_time_record import (  # noqa: E402
    order_agreement,
    record_layout,
)
from titan_trainer.dry_run.timing import (  # noqa: E402
    LAYOUTS,
    MODELS,
    measure_step,
    model_config,
    predict_cpu_job,
    simulate_for_cpu,
)


def machine() -> dict:
    from titan_trainer.dry_run.cpu_system import _cpu_name

    return {
        "cpu": _cpu_name(),
        "cores": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main(args: argparse.Namespace) -> None:
    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    names = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    facts = machine()
    lines: list[dict] = []
    records: list[dict] = []

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        lines.append(row)

    systems = {}
    for model in args.models.split(","):
        rows = []
        for name in names:
            world, extra = LAYOUTS[name]
            start = time.perf_counter()
            config = model_config(model, extra)
            sim = simulate_for_cpu(config, world, vocab)
            steps = args.steps or MODELS[model][3]
            warmup = args.warmup if args.warmup is not None else MODELS[model][4]
            run = measure_step(config, world, vocab, steps=steps, warmup=warmup)
            measured = run.seconds
            # This machine measured for `world` processes just after the run (each's share of a
            # core as other work on the machine leaves it).
            system = measured_cpu_system(world)
            systems[f"{model}, {name}"] = system
            job = predict_cpu_job(sim, system)
            slow = job.slowest
            row = {
                "model": model,
                "layout": name,
                "world_size": world,
                "measured_s": round(measured, 4),
                "predicted_s": round(job.step, 4),
                "error_pct": round(100 * (job.step - measured) / measured, 1),
                "free_cores": round(run.free_cores, 2),
                "compute_share": round(system.compute_share, 3),
                "compute_s": round(slow.compute, 4),
                "exposed_comm_s": round(slow.exposed, 4),
                "bubble_s": round(slow.bubble, 4),
                "seconds": round(time.perf_counter() - start, 1),
            }
            emit(row)
            rows.append(row)
            records.append(record_layout(model, name, sim, job, measured, system))
        measured = [r["measured_s"] for r in rows]
        predicted = [r["predicted_s"] for r in rows]
        agree, tau = order_agreement(measured, predicted)
        emit(
            {
                "summary": f"{model}: predicted vs measured step time",
                "layouts": len(rows),
                "max_abs_error_pct": max(abs(r["error_pct"]) for r in rows),
                "within_20_pct": sum(abs(r["error_pct"]) <= 20 for r in rows),
                "pairwise_order_agreement": round(agree, 3),
                "kendall_tau": round(tau, 3),
            }
        )
    first = next(iter(systems.values()))
    emit({"machine": facts, "system": first.name, **first.provenance})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in lines))
    if args.record:
        Path(args.record).write_text(
            json.dumps({"machine": facts, "layouts": records}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main(ARGS)
