"""The dry run's predicted throughput against published large-scale runs, as JSON lines.

    uv run python bench/step_time_published.py [--rows tt-8b-8gpu-fsdp,...] [--record]

Each row of `bench/published_throughput.jsonl` that Titan can express in bf16 (Llama 3.1
8B/70B/405B with the source's degrees, batch, sequence, activation checkpointing and compile)
is simulated at its real world size on fake tensors, exactly as `titan-train --dry-run` does;
its step is priced on the system the source ran on (`titan_trainer/dry_run/systems/`), and the
predicted tokens/s per GPU (or TFLOP/s per GPU, as the source states it) is compared with the
published figure: `error_pct` = (predicted - published) / published. With `--record` the
simulated work of each row is written to `bench/results/step_time_published.json`, which the
trainer's tests price again (no simulation) so that a change to the model shows there at once.
The last line summarises.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "bench" / "results" / "step_time_published.json"
CONFIGS = ROOT / "apps" / "trainer" / "configs"

_SHARD, _TP, _PP = (
    "--parallelism.data_parallel_shard_degree",
    "--parallelism.tensor_parallel_degree",
    "--parallelism.pipeline_parallel_degree",
)


_ASYNC = "--parallelism.enable_async_tensor_parallel"
# The Llama 3 paper's pipeline: TP 8 x PP 16 with an interleaved schedule, one sequence per
# microbatch (its batch per data-parallel rank is the number of microbatches).
_LLAMA3_PAPER_PP = [
    *(_TP, "8", _PP, "16"),
    *("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
    *("--parallelism.pipeline_parallel_microbatch_size", "1"),
]


def _run(flavor: str, lbs: int, ac: str, compile_: bool, *extra: str) -> list[str]:
    return [
        *("--job.config_file", str(CONFIGS / f"llama3_{flavor.lower()}.toml")),
        *("--training.local_batch_size", str(lbs), "--training.seq_len", "8192"),
        *("--activation_checkpoint.mode", ac, "--compile.enable", str(compile_).lower()),
        *extra,
    ]


# Published row id -> (the flags that express its layout, world size, system it ran on).
ROWS: dict[str, tuple[list[str], int, str]] = {
    "tt-8b-8gpu-fsdp": (_run("8b", 2, "selective", False), 8, "h100_torchtitan"),
    "tt-8b-8gpu-fsdp-compile": (_run("8b", 2, "selective", True), 8, "h100_torchtitan"),
    "tt-8b-128gpu-fsdp": (_run("8b", 2, "selective", False), 128, "h100_torchtitan"),
    "tt-asynctp-8b-64gpu-fsdp8-tp8-bf16-vanilla": (
        _run("8b", 12, "selective", True, _SHARD, "8", _TP, "8"),
        64,
        "h100_torchtitan",
    ),
    "tt-asynctp-70b-256gpu-fsdp32-tp8-bf16-vanilla": (
        _run("70b", 16, "full", True, _SHARD, "32", _TP, "8"),
        256,
        "h100_torchtitan",
    ),
    "tt-asynctp-8b-64gpu-fsdp8-tp8-bf16-async": (
        _run("8b", 12, "selective", True, _SHARD, "8", _TP, "8", _ASYNC, "true"),
        64,
        "h100_torchtitan",
    ),
    "tt-asynctp-70b-256gpu-fsdp32-tp8-bf16-async": (
        _run("70b", 16, "full", True, _SHARD, "32", _TP, "8", _ASYNC, "true"),
        256,
        "h100_torchtitan",
    ),
    "llama3-paper-405b-16384gpu-cp1-8k": (
        _run("405b", 16, "none", False, *_LLAMA3_PAPER_PP, _SHARD, "128"),
        16384,
        "h100_sxm",
    ),
    "llama3-paper-405b-16384gpu-cp16-128k": (
        [
            *_run("405b", 16, "none", False, *_LLAMA3_PAPER_PP, _SHARD, "8"),
            *("--training.seq_len", "131072", "--parallelism.context_parallel_degree", "16"),
        ],
        16384,
        "h100_sxm",
    ),
    "llama3-paper-405b-8192gpu-cp1-8k": (
        _run(
            "405b",
            32,
            "none",
            False,
            *(_SHARD, "64", _TP, "8", _PP, "16"),
            *("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
            *("--parallelism.pipeline_parallel_microbatch_size", "1"),
        ),
        8192,
        "h100_sxm",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None, help="comma-separated row ids (default: all)")
    parser.add_argument(
        "--record", action="store_true", help=f"write the simulated work to {RECORD}"
    )
    parser.add_argument(
        "--from-record",
        action="store_true",
        help="price the recorded work again instead of simulating",
    )
    return parser.parse_args(argv)


def published_rows() -> dict[str, dict]:
    rows = {}
    for line in (ROOT / "bench" / "published_throughput.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["id"]] = row
    return rows


def simulate_row(row_id: str) -> dict:
    """The row's simulated work, every rank role (the dry run's own simulation)."""
    from titan_core import load_config
    from titan_trainer.config import JobConfig
    from titan_trainer.dry_run.simulate import simulate
    from titan_trainer.dry_run.step_report import job_shape
    from titan_trainer.preflight import preflight

    flags, world, system = ROWS[row_id]
    config = load_config(JobConfig, [*flags, "--dry_run.world_size", str(world)])
    checked = preflight(config, world, dry_run=True)
    if checked.problems:
        raise SystemExit(f"{row_id}: {checked.problems}")
    start = time.perf_counter()
    sim = simulate(config, world, checked.vocab_size)
    stages = max(r.stages_on_rank for r in sim.roles)
    cp_style = checked.layout.cp_style() if checked.layout is not None else None
    shape = job_shape(config, world, stages, cp_style)
    return {
        "id": row_id,
        "flags": flags,
        "world_size": world,
        "system": system,
        "shape": shape.__dict__,
        "flops_per_token": sim.roles[0].flops_per_token,
        "roles": [{"role": r.role, "work": r.trace.to_dict()} for r in sim.roles],
        "simulated_s": round(time.perf_counter() - start, 1),
    }


def compare(record: dict, published: dict) -> dict:
    """The recorded row priced on its system against the published figure."""
    from titan_trainer.dry_run.hardware import load_system
    from titan_trainer.dry_run.step_report import JobPrediction
    from titan_trainer.dry_run.step_time import JobShape, predict
    from titan_trainer.dry_run.step_trace import StepWork

    system = load_system(record["system"])
    shape = JobShape(**record["shape"])
    roles = [
        predict(r["role"], StepWork.from_dict(r["work"]), shape, system) for r in record["roles"]
    ]
    job = JobPrediction(system, shape, roles, record["flops_per_token"])
    tps = job.tokens_per_second_per_device
    if published["metric"] == "tflops_per_gpu":
        predicted = tps * record["flops_per_token"] / 1e12
    else:
        predicted = tps
    value = published["value"]
    return {
        "id": record["id"],
        "source": published["source"],
        "model": published["model"],
        "gpus": published["gpus"],
        "system": system.name,
        "metric": published["metric"],
        "published": value,
        "predicted": round(predicted, 1),
        "error_pct": round(100 * (predicted - value) / value, 1),
        "predicted_step_s": round(job.step, 3),
        "predicted_mfu_pct": round(100 * job.mfu, 1),
        "exposed_comm_pct": round(100 * job.slowest.share("exposed"), 1),
        "bubble_pct": round(100 * job.slowest.share("bubble"), 1),
    }


def main(args: argparse.Namespace) -> None:
    rows = published_rows()
    ids = args.rows.split(",") if args.rows else list(ROWS)
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    errors = []
    for row_id in ids:
        if row_id not in ROWS:
            raise SystemExit(f"unknown row {row_id!r}; rows: {', '.join(ROWS)}")
        record = recorded.get(row_id) if args.from_record else simulate_row(row_id)
        if record is None:
            raise SystemExit(f"{row_id} is not recorded in {RECORD}; run without --from-record")
        recorded[row_id] = record
        result = compare(record, rows[row_id])
        errors.append(abs(result["error_pct"]))
        print(json.dumps(result), flush=True)
        if args.record:
            RECORD.write_text(json.dumps(recorded, indent=1) + "\n")
    print(
        json.dumps(
            {
                "summary": True,
                "rows": len(errors),
                "max_abs_error_pct": max(errors),
                "mean_abs_error_pct": round(sum(errors) / len(errors), 1),
            }
        )
    )


if __name__ == "__main__":
    main(parse_args())
