"""Which linears become Float8Linear, and why the others do not (meta device: 8B shapes are free)."""

from __future__ import annotations

import logging

import pytest
import torch
from float8_toy import LlamaShapes, TinyLM
from torch import nn
from torchao.float8 import _auto_filter_for_recipe
from torchao.float8.float8_linear import Float8Linear

from titan_core import ParallelDims
from titan_float8 import Float8, build_float8_converter, too_small_for_float8

BLOCK = [
    f"layers.{i}.{p}"
    for i in range(2)
    for p in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
]


def _convert(section: Float8, model: nn.Module | None = None, dims: ParallelDims | None = None):
    if model is None:
        with torch.device("meta"):
            model = LlamaShapes()
    converter = build_float8_converter(section, dims, device="cpu")
    converter.convert(model)
    return model, converter


def test_default_filter_keeps_output_in_high_precision():
    model, conv = _convert(Float8())
    assert conv.converted == BLOCK
    assert conv.skipped == {"output": "filter_fqns 'output'"}
    assert isinstance(model.layers["0"].attention["wq"], Float8Linear)
    assert type(model.output) is nn.Linear


def test_filter_fqns_match_substrings_of_names():
    _, conv = _convert(Float8(filter_fqns=["attention", "1.feed_forward.w2"]))
    assert set(conv.skipped) == {p for p in BLOCK if "attention" in p} | {
        "layers.1.feed_forward.w2"
    }
    assert "output" in conv.converted  # an empty-by-choice default: only what is listed stays


def test_dims_not_multiples_of_16_stay_and_tp_needs_16_per_shard():
    model = nn.Sequential(
        nn.Linear(64, 48), nn.Linear(48, 40), nn.Linear(40, 64), nn.Linear(64, 64)
    )
    _, conv = _convert(Float8(filter_fqns=[]), model)
    assert conv.converted == ["0", "3"]
    assert conv.skipped == {
        "1": "N=40, K=48 not multiples of 16",
        "2": "N=64, K=40 not multiples of 16",
    }
    # With TP 4, 48-wide layers would leave 12-wide shards.
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(64, 64))
    _, conv = _convert(Float8(filter_fqns=[]), model, ParallelDims(world_size=4, tp=4))
    assert conv.converted == ["1"]
    assert "per tensor-parallel shard of 4" in conv.skipped["0"]


@pytest.mark.parametrize(
    "recipe, kept",
    [
        # tensorwise skips K <= 4096 and N <= 1024: the 8B key/value projections (4096 -> 1024)
        (None, {"attention.wk", "attention.wv"}),
        # rowwise also needs N > 2048, K > 1024 and not (N <= 4096 and K <= 2048)
        ("rowwise", {"attention.wk", "attention.wv"}),
    ],
)
def test_auto_filter_small_kn_on_llama_8b_shapes(recipe, kept):
    _, conv = _convert(Float8(recipe_name=recipe, auto_filter_small_kn=True))
    assert {fqn.split(".", 2)[2] for fqn in conv.skipped if fqn != "output"} == kept
    assert all("too small" in conv.skipped[f"layers.0.{k}"] for k in kept)
    assert len(conv.converted) == len(BLOCK) - 2 * len(kept)


def test_auto_filter_small_kn_on_a_small_model_skips_every_layer():
    model, conv = _convert(Float8(auto_filter_small_kn=True), TinyLM())
    assert conv.converted == []
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_small_kn_thresholds_agree_with_installed_torchao(recipe):
    sizes = [256, 1024, 1040, 2048, 2064, 4096, 4112, 8192]
    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    for n in sizes:
        for k in sizes:
            with torch.device("meta"):
                linear = nn.Linear(k, n)
            assert too_small_for_float8(recipe, n, k) == (not theirs(linear, "x")), (n, k)


def test_convert_logs_counts_and_reasons(caplog):
    with caplog.at_level(logging.INFO, logger="titan"):
        _convert(Float8(recipe_name="rowwise", emulate=True))
    text = caplog.text
    assert "Float8 rowwise (emulated): converted 14 of 15 linear layers" in text
    assert "kept output in high precision: filter_fqns 'output'" in text


def test_meta_conversion_then_materialise_runs_forward():
    with torch.device("meta"):
        model = TinyLM()
    _, conv = _convert(Float8(emulate=True, enable_fsdp_float8_all_gather=True), model)
    model.to_empty(device="cpu")
    model.init_weights()
    assert conv.converted == ["layers.0.w1", "layers.0.w2", "layers.1.w1", "layers.1.w2"]
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
