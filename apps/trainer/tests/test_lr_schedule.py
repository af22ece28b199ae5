from __future__ import annotations

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
