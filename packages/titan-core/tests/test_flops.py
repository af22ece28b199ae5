"""The peak FLOP/s that MFU divides by: measured robustly, cached per machine, checked against
what the CPU reports, and measured without touching the global RNG."""

from __future__ import annotations

import json
import time

import pytest
import torch

from titan_core import (
    CpuBound,
    PeakFlops,
    cpu_peak_bound,
    measure_matmul_flops,
    peak_cache_file,
    peak_flops,
    two_significant,
)
from titan_core.flops import cpu_clock_mhz, machine_key, store_cached_peak, suspect_peak

CPU = torch.device("cpu")

# Shortened /proc/cpuinfo texts of real machines (one logical CPU shown; the flags that matter).
EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
cpu MHz\t\t: 2445.412
siblings\t: 2
cpu cores\t: 2
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
XEON_AVX512_HT = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8380 CPU @ 2.30GHz
cpu MHz\t\t: 800.000
siblings\t: 80
cpu cores\t: 40
flags\t\t: fpu sse sse2 fma avx avx2 avx512f avx512dq avx512bw avx512_bf16
"""
SAPPHIRE_RAPIDS_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
siblings\t: 1
cpu cores\t: 1
flags\t\t: fpu sse2 fma avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
# A Xeon by name with AVX-512 switched off (as some hypervisors do): only the flags count.
XEON_WITHOUT_AVX512 = XEON_AVX512_HT.replace(" avx512f avx512dq avx512bw avx512_bf16", "")
NEOVERSE_N1 = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
"""


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test gets its own peak cache: the user's own stays untouched."""
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "peak_flops.json"


@pytest.mark.parametrize(
    "value,text",
    [
        (0.0432, "0.043"),
        (0.17, "0.17"),
        (0.0996, "0.10"),
        (1.54, "1.5"),
        (12.34, "12"),
        (989.4, "990"),
        (0.0, "0"),
    ],
)
def test_two_significant_figures_never_round_a_small_peak_to_zero(value, text):
    assert two_significant(value) == text


def test_peak_is_described_with_two_significant_figures():
    # The old "%.1f" printed a 0.043 TFLOP/s CPU peak as "peak 0.0 TFLOP/s".
    assert PeakFlops(4.3e10, "measured: cpu").describe() == "0.043 TFLOP/s (measured: cpu)"
    assert PeakFlops(989.4e12, "datasheet: H100").describe().startswith("990 TFLOP/s")


def test_cpu_peak_is_measured_or_explicit_never_guessed():
    explicit = peak_flops(CPU, torch.float32, override_tflops=1.5)
    assert explicit.flops == 1.5e12 and explicit.source == "config"
    with pytest.raises(ValueError, match="metrics.peak_tflops"):
        peak_flops(CPU, torch.float32, calibrate=False)
    measured = peak_flops(CPU, torch.float32)
    assert measured.source.startswith("measured:")
    assert 1e8 < measured.flops < 1e14


def test_measured_peak_is_the_fastest_sample_not_an_average():
    best = measure_matmul_flops(CPU, torch.float32, size=256, min_seconds=0.05)
    a = torch.randn(256, 256)
    a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    average = 5 * 2 * 256**3 / (time.perf_counter() - start)
    # The fastest of >= 10 samples beats their average unless the machine got much busier in
    # between; half leaves room for that on a shared 2-core machine.
    assert best >= 0.5 * average


def test_measurement_leaves_the_global_rng_untouched():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    peak_flops(CPU, torch.float32, cache=False)
    measure_matmul_flops(CPU, torch.bfloat16, size=64, min_seconds=0.0, min_samples=1)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measurement_leaves_the_global_cuda_rng_untouched():
    cuda = torch.device("cuda")
    torch.cuda.manual_seed(1234)
    before_cpu, before_cuda = torch.get_rng_state(), torch.cuda.get_rng_state(cuda)
    measure_matmul_flops(cuda, torch.bfloat16, size=1024, min_seconds=0.0)
    assert torch.equal(torch.get_rng_state(), before_cpu)
    assert torch.equal(torch.cuda.get_rng_state(cuda), before_cuda)


def test_the_best_measurement_on_this_machine_is_kept(private_cache):
    first = peak_flops(CPU, torch.float32)
    key = machine_key(CPU, "fp32", torch.get_num_threads())
    assert json.loads(private_cache.read_text())[key] == first.flops
    # An earlier, quieter run measured more: a slower measurement now does not replace it.
    store_cached_peak(key, 100 * first.flops)
    again = peak_flops(CPU, torch.float32)
    assert again.flops == 100 * first.flops
    assert "best on this machine" in again.source
    assert json.loads(private_cache.read_text())[key] == 100 * first.flops
    # An earlier, slower one is replaced by the faster one measured now.
    store_cached_peak(key, 1.0)  # max() with what is there: stays
    assert json.loads(private_cache.read_text())[key] == 100 * first.flops
    private_cache.write_text(json.dumps({key: 1.0}))
    fresh = peak_flops(CPU, torch.float32)
    assert fresh.flops > 1.0 and json.loads(private_cache.read_text())[key] == fresh.flops


def test_cache_entries_are_per_dtype_threads_and_torch_version():
    keys = {
        machine_key(CPU, "fp32", 2),
        machine_key(CPU, "bf16", 2),
        machine_key(CPU, "fp32", 1),
    }
    assert len(keys) == 3
    assert all(torch.__version__ in k for k in keys)


def test_a_broken_or_unwritable_cache_costs_only_a_fresh_measurement(private_cache, monkeypatch):
    private_cache.parent.mkdir(parents=True)
    private_cache.write_text("{not json")
    assert peak_flops(CPU, torch.float32).source.startswith("measured:")
    assert json.loads(private_cache.read_text())  # rewritten whole
    blocker = private_cache.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TITAN_CACHE_DIR", str(blocker / "below-a-file"))
    assert peak_cache_file() == blocker / "below-a-file" / "peak_flops.json"
    assert peak_flops(CPU, torch.float32).flops > 0


def test_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TITAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peak_cache_file() == tmp_path / "titan" / "peak_flops.json"


@pytest.mark.parametrize(
    "cpuinfo,dtype,threads,cpus,mhz,flops,isa",
    [
        # 2 cores x 2.445 GHz x 8 fp32 lanes x 2 (FMA) x 2 units
        (EPYC_AVX2, "fp32", 2, 2, None, 2 * 2445.412e6 * 32, "AVX2, FMA"),
        (EPYC_AVX2, "fp32", 1, 2, None, 2445.412e6 * 32, "AVX2, FMA"),
        # no native bf16: at most the fp32 rate
        (EPYC_AVX2, "bf16", 2, 2, None, 2 * 2445.412e6 * 32, "AVX2, FMA"),
        # 8 threads on 4 hyperthreaded logical CPUs are 2 cores; nominal clock from the name
        (XEON_AVX512_HT, "fp32", 8, 4, None, 2 * 2.3e9 * 64, "AVX-512, FMA"),
        (XEON_AVX512_HT, "bf16", 2, 4, None, 2 * 2.3e9 * 128, "avx512_bf16"),
        (XEON_WITHOUT_AVX512, "fp32", 2, 4, None, 2 * 2.3e9 * 32, "AVX2, FMA"),
        (SAPPHIRE_RAPIDS_AMX, "bf16", 1, 1, 3800.0, 3.8e9 * 1024, "AMX bf16"),
        (SAPPHIRE_RAPIDS_AMX, "fp32", 1, 1, 3800.0, 3.8e9 * 64, "AVX-512, FMA"),
        (NEOVERSE_N1, "fp32", 4, 4, 3000.0, 4 * 3e9 * 16, "NEON, FMA"),
    ],
)
def test_cpu_bound_comes_from_the_units_the_cpu_reports(
    cpuinfo, dtype, threads, cpus, mhz, flops, isa
):
    bound = cpu_peak_bound(dtype, threads, cpuinfo=cpuinfo, max_mhz=mhz, cpus=cpus)
    assert bound is not None
    assert bound.flops == pytest.approx(flops)
    assert isa in bound.detail


def test_cpu_bound_is_none_when_something_is_unknown():
    assert cpu_peak_bound("fp32", 2, cpuinfo="processor\t: 0\n") is None  # no flags
    assert cpu_peak_bound("fp8", 2, cpuinfo=EPYC_AVX2) is None
    assert cpu_peak_bound("fp32", 2, cpuinfo=NEOVERSE_N1) is None  # no clock in the text
    assert cpu_peak_bound("fp32", 2, cpuinfo=NEOVERSE_N1 + "Features\t: sve\n") is None


def test_cpu_clock_prefers_the_highest_reported_figure():
    assert cpu_clock_mhz(XEON_AVX512_HT, "3400000\n") == (3400.0, "maximum")
    assert cpu_clock_mhz(XEON_AVX512_HT) == (2300.0, "nominal")  # not the idle 800 MHz
    assert cpu_clock_mhz(EPYC_AVX2) == (2445.412, "reported")
    assert cpu_clock_mhz(NEOVERSE_N1) is None


def test_this_machines_bound_is_read_when_linux_reports_it():
    with open("/proc/cpuinfo") as f:
        text = f.read()
    if "flags" not in text and "Features" not in text:
        pytest.skip("this system's /proc/cpuinfo lists no CPU features")
    bound = cpu_peak_bound("fp32", 1)
    if bound is None:
        assert "cpu MHz" not in text and "GHz" not in text  # no clock is the only excuse
    else:
        assert bound.flops > 1e9 and "1 core x" in bound.detail


def test_a_measurement_far_below_the_bound_is_called_out():
    bound = CpuBound(156e9, "2 cores x 2.4 GHz x 32 fp32 FLOP/cycle (AVX2, FMA)")
    assert suspect_peak(100e9, bound) is None
    warning = suspect_peak(30e9, bound)
    assert warning is not None
    assert "0.030 TFLOP/s" in warning and "0.16 TFLOP/s" in warning
    assert "--metrics.peak_tflops" in warning
