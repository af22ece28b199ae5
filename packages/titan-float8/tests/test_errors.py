"""Config problems and unsupported combinations fail up front with a message that says what to do."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from torch import nn
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

from titan_core import ConfigError, ParallelDims, load_config, plugins, resolve
from titan_float8 import Float8, build_float8_converter, float8_tp_styles, skip_reason
from titan_float8.hardware import cuda_capability_problem


@dataclass
class Linear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: Linear = field(default_factory=Linear)


@dataclass
class Root:
    quantize: Quantize = field(default_factory=Quantize)


def test_torchtitan_keys_load_from_the_command_line():
    cfg = load_config(
        Root,
        [
            "--quantize.linear.float8.recipe_name",
            "rowwise",
            "--quantize.linear.float8.filter_fqns",
            "output,router",
        ],
    )
    assert cfg.quantize.linear.float8.recipe == "rowwise"
    assert cfg.quantize.linear.float8.filter_fqns == ["output", "router"]


def test_unknown_recipe_names_the_allowed_ones_and_a_close_match():
    with pytest.raises(ConfigError) as err:
        load_config(Root, ["--quantize.linear.float8.recipe_name", "rowwize"])
    text = str(err.value)
    assert 'recipe_name = "rowwize" is not a torchao Float8 recipe' in text
    assert "'tensorwise', 'rowwise', 'rowwise_with_gw_hp'" in text
    assert "did you mean rowwise?" in text


@pytest.mark.parametrize(
    "section, message",
    [
        (
            Float8(recipe_name="rowwise", enable_fsdp_float8_all_gather=True),
            'enable_fsdp_float8_all_gather = true needs the tensorwise recipe, not "rowwise"',
        ),
        (
            Float8(precompute_float8_dynamic_scale_for_fsdp=True),
            "precompute_float8_dynamic_scale_for_fsdp = true needs enable_fsdp_float8_all_gather = true",
        ),
        (Float8(filter_fqns=["output", ""]), "filter_fqns contains an empty string"),
    ],
)
def test_impossible_combinations_are_rejected_by_the_factory(section, message):
    assert any(message in p for p in section.validate())
    with pytest.raises(ConfigError, match=message):
        build_float8_converter(section, None, device="cpu")


def test_old_gpu_error_names_emulate():
    problem = cuda_capability_problem((8, 0))  # A100
    assert "needs CUDA compute capability 8.9 or newer" in problem and "this GPU has 8.0" in problem
    assert "emulate = true" in problem
    assert cuda_capability_problem((9, 0)) is None


def test_tp_styles_are_torchao_float8_styles_for_tensorwise_only():
    styles = float8_tp_styles(Float8())
    assert styles["colwise"] is Float8ColwiseParallel and styles["rowwise"] is Float8RowwiseParallel
    with pytest.raises(ConfigError, match="support only the tensorwise recipe"):
        float8_tp_styles(Float8(recipe_name="rowwise"))


def test_all_gather_without_fsdp_is_turned_off_with_a_warning(caplog):
    section = Float8(
        enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True
    )
    conv = build_float8_converter(section, ParallelDims(world_size=1), device="cpu")
    assert not conv.section.enable_fsdp_float8_all_gather
    assert not conv.section.precompute_float8_dynamic_scale_for_fsdp
    assert "has no effect without FSDP" in caplog.text


def test_a_bare_linear_is_refused():
    with pytest.raises(TypeError, match="wrap a bare nn.Linear"):
        build_float8_converter(Float8(emulate=True), device="cpu").convert(nn.Linear(16, 16))


def test_entry_point_resolves_to_the_factory():
    assert resolve(plugins.CONVERTERS, "quantize.linear.float8") is build_float8_converter


def test_torchtitans_auto_filter_switch_in_filter_fqns_turns_the_filter_on(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="titan"):
        cfg = load_config(
            Root, ["--quantize.linear.float8.filter_fqns", "output,auto_filter_small_kn"]
        )
    section = cfg.quantize.linear.float8
    assert section.auto_filter_small_kn and section.filter_fqns == ["output"]
    assert any("is torchtitan's switch" in r.getMessage() for r in caplog.records)
    # A module named like the switch is not filtered by name any more: by size, it is.
    small = nn.Linear(64, 64)
    assert skip_reason(small, "layers.0.auto_filter_small_kn", section) == (
        "N=64, K=64 too small for tensorwise Float8 to pay off (auto_filter_small_kn)"
    )
