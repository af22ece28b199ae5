"""A recorded validation of the step-time model: each layout's traced work (every rank role's
`StepWork`), its job shape, the system it was priced on and its measured seconds, as JSON, so
that a change to the model (`titan_trainer.dry_run.step_time`) can be re-checked against the
measurement in milliseconds (`apps/trainer/tests/test_step_time_cpu.py`); written by
`bench/step_time_cpu.py --record`."""

from __future__ import annotations

import dataclasses
import itertools

from titan_trainer.dry_run.hardware import Link, System
from titan_trainer.dry_run.simulate import Simulation
from titan_trainer.dry_run.step_report import JobPrediction
from titan_trainer.dry_run.step_time import JobShape, predict
from titan_trainer.dry_run.step_trace import StepWork


def record_layout(
    model: str, layout: str, sim: Simulation, job: JobPrediction, measured: float, system: System
) -> dict:
    return {
        "system": system_to_dict(system),
        "model": model,
        "layout": layout,
        "world_size": sim.world_size,
        "measured_s": measured,
        "predicted_s": job.step,
        "shape": dataclasses.asdict(job.shape),
        "roles": {r.role: dataclasses.asdict(r.trace) for r in sim.roles},
    }


def reprice(record: dict, system: System | None = None) -> float:
    """The recorded layout's predicted step by the current model, on `system` (default: the
    system it was recorded with)."""
    system = system or system_from_dict(record["system"])
    shape = JobShape(**record["shape"])
    return max(
        predict(role, StepWork.from_dict(work), shape, system).step
        for role, work in record["roles"].items()
    )


def system_to_dict(system: System) -> dict:
    return dataclasses.asdict(system)


def system_from_dict(data: dict) -> System:
    data = dict(data)
    for link in ("intra_node", "inter_node"):
        data[link] = Link(**data[link])
    data["links_by_kind"] = {k: Link(**v) for k, v in data.get("links_by_kind", {}).items()}
    return System(**data)


def order_agreement(measured: list[float], predicted: list[float]) -> tuple[float, float]:
    """(the share of layout pairs both order the same way, Kendall's tau). Pairs whose
    measured times are within 5% of each other are ties (no order to get right), left out."""
    agree = disagree = 0
    for i, j in itertools.combinations(range(len(measured)), 2):
        m = measured[i] - measured[j]
        if abs(m) <= 0.05 * max(measured[i], measured[j]):
            continue
        p = predicted[i] - predicted[j]
        if m * p > 0:
            agree += 1
        else:
            disagree += 1
    pairs = agree + disagree
    if not pairs:
        return 1.0, 1.0
    return agree / pairs, (agree - disagree) / pairs
