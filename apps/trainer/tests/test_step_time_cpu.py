"""The dry run's predicted step time against measured CPU runs.

`data/step_time_cpu.json` is a recorded `bench/step_time_cpu.py --record` run: for each layout
of the debug model and of Llama 3's 100M flavor, every rank role's traced work, the measured
system it was priced on (this kind of machine: one thread per gloo process) and the measured
seconds per step. The fast tests re-price the recorded work with the current step-time model:
within 20% of the measurement, and the layouts ranked as measured.
The slow test measures this machine and reruns three layouts for real. After a change to the
model or the measurement, `bench/step_time_cpu.py --record` on a quiet machine re-records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan_trainer.dry_run.step_time_record import (
    order_agreement,
    reprice,
    system_from_dict,
    system_to_dict,
)
from titan_trainer.dry_run.step_trace import StepWork

RECORD = Path(__file__).parent / "data" / "step_time_cpu.json"
TOLERANCE = 0.20


def _recorded(model: str) -> list[dict]:
    layouts = [r for r in json.loads(RECORD.read_text())["layouts"] if r["model"] == model]
    assert len(layouts) >= 8, f"{model}: {len(layouts)} layouts recorded"
    return layouts


def _error(model: str, layout: str) -> float:
    (r,) = [r for r in _recorded(model) if r["layout"] == layout]
    return (reprice(r) - r["measured_s"]) / r["measured_s"]


@pytest.mark.parametrize(
    ("model", "layout"),
    [(r["model"], r["layout"]) for r in json.loads(RECORD.read_text())["layouts"]],
)
def test_recorded_layout_is_predicted_within_20_percent(model, layout):
    # The recorded run: all sixteen within 20%, the largest miss 18.5% (the debug model's
    # FSDP 2 x TP 2, four processes on two cores), every miss over 10% an under-prediction.
    error = _error(model, layout)
    assert abs(error) <= TOLERANCE, f"{model}, {layout}: predicted {100 * error:+.1f}%"


@pytest.mark.parametrize("model", ["debug", "100M"])
def test_recorded_layouts_rank_as_measured(model):
    layouts = _recorded(model)
    agree, _ = order_agreement([r["measured_s"] for r in layouts], [reprice(r) for r in layouts])
    # Pairs measured within 5% of each other are ties. The recorded run orders all of them as
    # measured: the debug model's 25 pairs and the 100M model's 27.
    assert agree == 1.0, f"{model}: {agree:.0%} of the layout pairs ordered as measured"


def test_the_recording_round_trips():
    # The recorded work and system are read back whole: the fields the model prices are all
    # there (a field added to StepWork or System and left out of the record fails here).
    for r in json.loads(RECORD.read_text())["layouts"]:
        system = system_from_dict(r["system"])
        assert system_to_dict(system) == r["system"]
        for work in r["roles"].values():
            assert StepWork.from_dict(work).to_dict() == work


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1 process", "FSDP 2", "PP 2 (1F1B)"])
def test_measured_runs_are_predicted_within_20_percent(layout):
    from titan_core import plugins, resolve
    from titan_trainer.dry_run.cpu_system import measured_cpu_system
    from titan_trainer.dry_run.timing import (
        LAYOUTS,
        measure_step,
        model_config,
        predict_cpu_job,
        simulate_for_cpu,
    )

    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    world, extra = LAYOUTS[layout]
    config = model_config("debug", extra)
    sim = simulate_for_cpu(config, world, vocab)
    run = measure_step(config, world, vocab, steps=4, warmup=1)
    system = measured_cpu_system(world)
    predicted = predict_cpu_job(sim, system).step
    assert predicted == pytest.approx(run.seconds, rel=TOLERANCE), (predicted, run)
