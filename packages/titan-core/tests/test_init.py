"""Initial values as a function of (seed, parameter name): the plain-tensor side.

Sharded parameters (every rank draws only its blocks) are checked against these values on real
process groups in titan-parallel's tests.
"""

import math

import pytest
import torch
from torch import nn

from titan_core import init as init_mod
from titan_core.init import (
    ParamInit,
    block_seed,
    canonical_name,
    draw_block,
    init_from_plan_,
    init_parameter_,
    row_blocks,
)


def test_blocks_cover_every_row_once_and_depend_only_on_the_shape(monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_ELEMENTS", 1000)
    blocks = row_blocks((95, 30))  # 33 rows of 30 per block
    assert blocks == [(0, 33), (33, 66), (66, 95)]
    assert row_blocks((7,)) == [(0, 7)]
    assert row_blocks(()) == [(0, 1)]
    assert row_blocks((3, 5000)) == [(0, 1), (1, 2), (2, 3)]  # a row larger than a block


def test_values_depend_on_seed_and_key_not_on_call_order():
    plan = {"a": ParamInit("normal", std=1.0), "b": ParamInit("normal", std=1.0)}
    first, second = nn.ParameterDict(), nn.ParameterDict()
    for store in (first, second):
        store["a"] = nn.Parameter(torch.empty(40, 8))
        store["b"] = nn.Parameter(torch.empty(40, 8))
    init_from_plan_(first, plan, seed=3)
    # Reversed order of initialisation, a different global RNG state: same values.
    torch.manual_seed(999)
    init_parameter_(second["b"], plan["b"], seed=3, key="b")
    init_parameter_(second["a"], plan["a"], seed=3, key="a")
    assert torch.equal(first["a"], second["a"]) and torch.equal(first["b"], second["b"])
    assert not torch.equal(first["a"], first["b"])  # the name is part of the draw
    other = torch.empty(40, 8)
    init_parameter_(other, plan["a"], seed=4, key="a")
    assert not torch.equal(other, first["a"])  # so is the seed


def test_global_rng_is_left_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    init_parameter_(torch.empty(64, 64), ParamInit("normal"), seed=1, key="w")
    assert torch.equal(before, torch.get_rng_state())


def test_truncated_normal_stays_within_its_bounds_with_the_right_spread():
    t = torch.empty(400, 500)
    init_parameter_(t, ParamInit.truncated(0.02), seed=0, key="w")
    assert t.abs().max().item() <= 0.06 + 1e-7
    # A normal truncated at 3 sigma has std 0.02 * 0.9866 (and mean 0).
    assert t.std().item() == pytest.approx(0.02 * 0.9866, rel=0.01)
    assert abs(t.mean().item()) < 0.02 * 3 / math.sqrt(t.numel())


def test_kinds_constant_uniform_normal():
    t = torch.empty(1000)
    init_parameter_(t, ParamInit("constant", value=1.5), seed=0, key="n")
    assert torch.all(t == 1.5)
    init_parameter_(t, ParamInit("uniform", a=-0.5, b=0.25), seed=0, key="u")
    assert t.min().item() >= -0.5 and t.max().item() <= 0.25
    init_parameter_(t, ParamInit("normal", mean=2.0, std=0.1), seed=0, key="g")
    assert t.mean().item() == pytest.approx(2.0, abs=0.02)
    with pytest.raises(ValueError, match="unknown ParamInit kind"):
        draw_block(ParamInit("laplace"), (3,), 0, seed=0, key="x", device="cpu")


def test_tied_parameters_share_one_draw_through_the_key():
    shared = ParamInit.truncated(0.1, key="output.weight")
    a, b = torch.empty(10, 4), torch.empty(10, 4)
    init_parameter_(a, shared, seed=0, key=shared.key)
    init_parameter_(b, shared, seed=0, key=shared.key)
    assert torch.equal(a, b)


def test_wrapper_prefixes_are_ignored_and_missing_rules_reported():
    assert canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    assert canonical_name("layers.1._orig_mod.w.weight") == "layers.1.w.weight"
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, bias=False))
    missing = init_from_plan_(model, {"0.weight": ParamInit("normal")}, seed=0)
    assert missing == ["0.bias", "1.weight"]


def test_buffers_named_in_the_plan_are_filled_and_the_others_left_alone():
    model = nn.Linear(3, 3)
    model.register_buffer("bias_state", torch.full((4,), float("nan")))  # as to_empty leaves it
    model.register_buffer("table", torch.arange(4.0), persistent=False)
    plan = {"weight": ParamInit("normal"), "bias": ParamInit("normal"),
            "bias_state": ParamInit("constant", value=0.0)}  # fmt: skip
    assert init_from_plan_(model, plan, seed=0) == []
    assert torch.equal(model.bias_state, torch.zeros(4))
    assert torch.equal(model.table, torch.arange(4.0))


def test_block_seeds_are_distinct_and_stable():
    seeds = {block_seed(0, "w", i) for i in range(100)}
    assert len(seeds) == 100
    assert block_seed(7, "layers.3.attention.wq.weight", 2) == block_seed(
        7, "layers.3.attention.wq.weight", 2
    )
