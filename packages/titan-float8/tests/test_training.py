"""Float8 training tracks the fp32 run, emulated and through CPU torch._scaled_mm."""

from __future__ import annotations

import pytest
import torch
from float8_toy import TinyLM, batches, train

from titan_float8 import Float8, build_float8_converter, float8_hardware_problem

STEPS = 25


def _run(section: Float8 | None, data, compile_backend: str | None = None) -> list[float]:
    torch.manual_seed(0)
    model = TinyLM()
    if section is not None:
        build_float8_converter(section, device="cpu").convert(model)
    model.init_weights()
    if compile_backend:
        model = torch.compile(model, backend=compile_backend)
    return train(model, data)


@pytest.fixture(scope="module")
def data():
    return batches(STEPS)


@pytest.fixture(scope="module")
def fp32(data):
    return torch.tensor(_run(None, data))


def _cpu_scaled_mm_available() -> bool:
    return float8_hardware_problem("cpu", emulate=False) is None


@pytest.mark.parametrize(
    "section",
    [
        Float8(emulate=True),
        Float8(recipe_name="rowwise", emulate=True),
        Float8(recipe_name="rowwise_with_gw_hp", emulate=True),
        pytest.param(
            Float8(),
            marks=pytest.mark.skipif(
                not _cpu_scaled_mm_available(), reason="this torch has no CPU _scaled_mm"
            ),
            id="tensorwise-real-cpu-scaled-mm",
        ),
    ],
    ids=lambda s: f"{s.recipe}-emulated" if isinstance(s, Float8) else None,
)
def test_float8_loss_stays_within_1_percent_of_fp32(section, data, fp32):
    got = torch.tensor(_run(section, data))
    # Float8 e4m3 keeps 3 mantissa bits, but the loss averages thousands of rounded products;
    # measured drift over 25 AdamW steps is <= 0.25%. 1% at every step catches a wrong scale
    # (which moves the loss by tens of percent) while leaving room for the recipes' rounding.
    assert ((got - fp32).abs() / fp32).max() < 0.01
    assert got[-1] < 0.8 * got[0]  # and it learns


@pytest.mark.skipif(not _cpu_scaled_mm_available(), reason="this torch has no CPU _scaled_mm")
def test_real_cpu_scaled_mm_matches_emulation(data):
    emulated = torch.tensor(_run(Float8(emulate=True), data[:8]))
    real = torch.tensor(_run(Float8(), data[:8]))
    # Same Float8 operands and scales; the kernels differ only in accumulation order (and the
    # real kernel rounds its output to the output dtype once). Measured: 5e-5 relative.
    torch.testing.assert_close(real, emulated, rtol=1e-3, atol=0)


def test_float8_model_compiles_and_matches_eager(data):
    # aot_eager traces the Float8 tensor subclasses through dynamo and AOTAutograd (the part
    # that breaks when a subclass is not compile-friendly) without paying for C++ codegen here;
    # inductor codegen runs in bench/float8.py on a GPU.
    eager = torch.tensor(_run(Float8(emulate=True), data[:3]))
    compiled = torch.tensor(_run(Float8(emulate=True), data[:3], compile_backend="aot_eager"))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
