from __future__ import annotations

import logging
import math

import pytest
import torch

from titan_trainer.config import LRScheduler
from titan_trainer.lr_schedule import build_lr_scheduler, lr_factor, schedule_phases


def test_phases_add_up_and_follow_decay_ratio():
    assert schedule_phases(100, 10, None) == (10, 0, 90)
    assert schedule_phases(100, 10, 0.2) == (10, 70, 20)
    assert schedule_phases(10, 20, 0.5) == (10, 0, 0)  # warm-up longer than the run
    assert schedule_phases(100, 10, 0.95) == (10, 0, 90)  # decay cannot eat the warm-up


@pytest.mark.parametrize(
    "decay_type,curve",
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_exact_factors_for_warmup_stable_decay(decay_type, curve):
    # 4 warm-up, 2 stable, 4 decay steps, decaying to 10% of the peak.
    kw = dict(warmup=4, stable=2, decay=4, decay_type=decay_type, min_lr_factor=0.1)
    factors = [lr_factor(s, **kw) for s in range(10)]
    assert factors[:4] == [1 / 5, 2 / 5, 3 / 5, 4 / 5]
    assert factors[4:6] == [1.0, 1.0]
    for i, p in enumerate([0.25, 0.5, 0.75, 1.0]):
        assert factors[6 + i] == pytest.approx(0.1 + 0.9 * curve(p), abs=1e-15)
    assert factors[-1] == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2.0)
    sched = build_lr_scheduler(
        opt, LRScheduler(warmup_steps=2, decay_ratio=None, decay_type="linear"), total_steps=6
    )
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2 / 3, 4 / 3, 2 * 0.75, 2 * 0.5, 2 * 0.25, 0.0])


def _schedule(steps: int, **kw):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0, **kw)
    return optimizer, build_lr_scheduler(optimizer, cfg, steps)


def _run(optimizer, scheduler, n: int) -> list[float]:
    lrs = []
    for _ in range(n):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_resume_with_the_same_settings_continues_the_schedule_exactly():
    optimizer, scheduler = _schedule(10)
    uninterrupted = _run(optimizer, scheduler, 10)
    optimizer, scheduler = _schedule(10)
    first = _run(optimizer, scheduler, 6)
    state = scheduler.state_dict()
    optimizer2, scheduler2 = _schedule(10)
    scheduler2.load_state_dict(state)
    assert first + _run(optimizer2, scheduler2, 4) == uninterrupted


def test_extending_a_run_follows_the_new_schedule_from_the_first_resumed_step(caplog):
    import logging

    optimizer, scheduler = _schedule(10)
    _run(optimizer, scheduler, 8)  # steps 9 and 10 of the 10-step run would end the decay
    state = scheduler.state_dict()
    optimizer2, scheduler2 = _schedule(20)  # extended to 20 steps: stable until step 10
    with caplog.at_level(logging.WARNING, logger="titan"):
        scheduler2.load_state_dict(state)
    resumed = _run(optimizer2, scheduler2, 12)
    expected = [lr_factor(s, warmup=2, stable=8, decay=10) for s in range(8, 20)]
    # The first resumed step already uses the 20-step schedule (not the checkpoint's lr).
    assert resumed == pytest.approx(expected)
    assert resumed[0] == 1.0  # back in the stable phase
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("titan")]
    assert len(messages) == 1 and "total_steps 10 -> 20" in messages[0], messages
    # old 10-step schedule at step 9: 2 warm-up, 3 stable, decay 4/5 done -> factor 0.2
    assert "from step 9 on: lr 0.2 there under the old schedule (factor 0.2)" in messages[0]
    assert "1 under the new one (factor 1)" in messages[0], messages


def test_a_resumed_run_takes_its_lr_from_the_config_whatever_the_optimizer_loaded(caplog):
    """DCP loads the schedule before the optimizer, whose param_groups then hold the saving
    run's lr; the checkpoint's own peak is the old [optimizer] lr. Neither decides the lr."""
    import logging

    optimizer, scheduler = _schedule(10)
    _run(optimizer, scheduler, 3)
    saved_scheduler, saved_optimizer = scheduler.state_dict(), optimizer.state_dict()
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer2 = torch.optim.SGD([param], lr=0.5)  # a new peak: [optimizer] lr 1 -> 0.5
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.0)
    scheduler2 = build_lr_scheduler(optimizer2, cfg, 10)
    with caplog.at_level(logging.WARNING, logger="titan"):
        scheduler2.load_state_dict(saved_scheduler)
    optimizer2.load_state_dict(saved_optimizer)  # the order DCP loads them in
    assert optimizer2.param_groups[0]["lr"] == 1.0  # the saving run's lr for step 4
    scheduler2.apply()
    resumed = _run(optimizer2, scheduler2, 7)
    assert resumed == pytest.approx(
        [0.5 * lr_factor(s, warmup=2, stable=3, decay=5) for s in range(3, 10)]
    )
    (message,) = [r.getMessage() for r in caplog.records if r.name.startswith("titan")]
    assert "[optimizer] lr 1 -> 0.5" in message and "lr 1 there" in message, message


def _warnings(caplog, warmup: int, steps: int) -> tuple[list[float], list[str]]:
    caplog.clear()
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="titan"):
        scheduler = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=warmup), steps)
    lrs = _run(optimizer, scheduler, steps)
    return lrs, [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]


def test_a_warmup_longer_than_the_run_is_cut_to_it_and_said_with_the_effective_warmup(caplog):
    # The run: warm-up 100 on 6 steps follows a 6-step warm-up (torchtitan's rule).
    lrs, said = _warnings(caplog, warmup=100, steps=6)
    assert lrs == pytest.approx([1e-3 * (s + 1) / 7 for s in range(6)])
    assert said == [
        "[lr_scheduler] warmup_steps = 100 is longer than the run ([training] steps = 6): the"
        " warm-up is cut to the run's 6 steps, so the learning rate only rises, to 6/7 of the"
        " peak (0.00086 of [optimizer] lr = 0.001) at the last step, and never decays; set"
        " warmup_steps below training.steps (a tenth to a fifth of them) for a warm-up, a"
        " plateau and a decay"
    ]


def test_a_warmup_as_long_as_the_run_is_said_and_a_shorter_one_is_not(caplog):
    _, said = _warnings(caplog, warmup=10, steps=10)
    assert len(said) == 1 and "warmup_steps = 10 covers the whole run" in said[0], said
    assert "10/11 of the peak" in said[0]
    _, said = _warnings(caplog, warmup=9, steps=10)
    assert said == []
