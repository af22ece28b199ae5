"""The trainer's view of mixture-of-experts load, on real titan-models `MoE` layers in one
process: each layer's max/mean tokens per expert by block name, the worst of a logging window,
and one warning when a layer stays above 2.0 for 20 steps in a row."""

from __future__ import annotations

import logging

import torch
from torch import nn

from titan_core import ParallelDims
from titan_models.moe import MoE, MoEArgs
from titan_trainer.experts import COLLAPSE_STEPS, ExpertLoad
from titan_trainer.metrics import format_line


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        args = MoEArgs(num_experts=4, top_k=1, hidden_dim=8)
        self.layers = nn.ModuleDict({str(i): nn.Module() for i in range(2)})
        for block in self.layers.values():
            block.moe = MoE(16, args)


def _step(load: ExpertLoad, model: _Blocks, first: list[float], second: list[float]) -> None:
    for block, counts in zip(model.layers.values(), (first, second)):
        block.moe.tokens_per_expert += torch.tensor(counts)
    load.after_step()


def test_each_layer_is_read_by_name_and_a_lasting_collapse_is_warned_once(caplog):
    model = _Blocks()
    load = ExpertLoad([model], ParallelDims(world_size=1), accum=1)
    even, skewed, collapsed = [4.0] * 4, [6.0, 4.0, 3.0, 3.0], [16.0, 0.0, 0.0, 0.0]
    _step(load, model, even, skewed)
    _step(load, model, even, even)
    # The highest of the window per layer: 6 / 4 for the second.
    assert load.read() == {"layers.0": 1.0, "layers.1": 1.5}
    line = format_line(2, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0,
                           "tflops": 0.0, "mfu_pct": 0.0, "mem_peak_gib": 0.0, "step_time_s": 1.0,
                           "expert_load": 1.5, "expert_load/layers.0": 1.0,
                           "expert_load/layers.1": 1.5})  # fmt: skip
    assert line.endswith("| experts max/mean 1.50 (1.00 1.50)"), line
    with caplog.at_level(logging.WARNING):
        for _ in range(COLLAPSE_STEPS - 1):  # one step short of the warning
            _step(load, model, collapsed, even)
        _step(load, model, even, even)  # the streak is broken...
        assert load.read() == {"layers.0": 4.0, "layers.1": 1.0}
        assert not caplog.records
        for _ in range(COLLAPSE_STEPS):  # ...and a whole one follows
            _step(load, model, even, collapsed)
        load.read()
        for _ in range(COLLAPSE_STEPS):
            _step(load, model, even, collapsed)
        load.read()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "in layers.1 the busiest expert" in warnings[0], warnings
    # The biases moved too (titan-models' update): down for the busy expert.
    assert model.layers["1"].moe.expert_bias[0] < 0


def test_under_a_capacity_the_re_routed_share_shows_what_the_even_load_hides():
    # Every token alike: a plain top-1 sends all 8 of a sequence's tokens to one expert. A
    # capacity of 1.0 x the even share (8 / 4 = 2 per expert) keeps the first 2 there and
    # re-routes the other 6: the load reads as even, the share says the router is collapsed.
    layer = MoE(16, MoEArgs(num_experts=4, top_k=1, hidden_dim=8, capacity_factor=1.0))
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module()})
    model.layers["0"].moe = layer
    load = ExpertLoad([model], ParallelDims(world_size=1), accum=1)
    layer.train()
    layer(torch.ones(2, 8, 16))
    load.after_step()
    assert load.read() == {"layers.0": 1.0}
    assert load.read_rerouted() == {"layers.0": 0.75}
    assert load.read_rerouted() is None  # counted again from the next step
    line = format_line(1, {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0,
                           "tflops": 0.0, "mfu_pct": 0.0, "mem_peak_gib": 0.0, "step_time_s": 1.0,
                           "expert_load": 1.0, "expert_rerouted_pct": 75.0})  # fmt: skip
    assert line.endswith("| experts max/mean 1.00 | re-routed 75%"), line
    # Without a capacity nothing is re-routed and no share is reported.
    plain = ExpertLoad([_Blocks()], ParallelDims(world_size=1), accum=1)
    plain.after_step()
    assert plain.read_rerouted() is None
