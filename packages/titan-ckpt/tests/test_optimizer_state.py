"""OptimizerState loads the whole state into an optimizer that has never stepped, whatever
its parameters hold: a fault-tolerant replica group receives a live group's state after its
own backward, with gradients present."""

from __future__ import annotations

import torch
from torch import nn

from titan_ckpt import OptimizerState


def _model_and_adamw(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _backward(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 8)).square().mean().backward()


def test_an_optimizer_that_never_stepped_loads_every_moment_with_gradients_present():
    live, live_opt = _model_and_adamw(0)
    for step in range(2):
        _backward(live, step)
        live_opt.step()
        live_opt.zero_grad()
    sent = OptimizerState(live, live_opt).state_dict()

    late, late_opt = _model_and_adamw(0)
    _backward(late, 7)  # its own step's backward, before the state arrives
    grads = [p.grad.clone() for p in late.parameters()]
    OptimizerState(late, late_opt).load_state_dict(sent)

    # Every moment and step count arrived (torch alone loaded none of them here).
    assert len(late_opt.state) == len(live_opt.state) == 4
    for p_live, p_late in zip(live.parameters(), late.parameters(), strict=True):
        for key, value in live_opt.state[p_live].items():
            assert torch.equal(late_opt.state[p_late][key], value), key
    # The step's gradients are as the backward left them, to be averaged and applied.
    for p, grad in zip(late.parameters(), grads, strict=True):
        assert torch.equal(p.grad, grad)
    # And the parameters were not touched by the load (torch initialises the state with a step
    # at lr 0).
    fresh, _ = _model_and_adamw(0)
    for p, q in zip(late.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
