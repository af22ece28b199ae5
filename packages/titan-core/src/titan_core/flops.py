"""Peak FLOP/s of the device, the denominator of MFU.

Known accelerators come from their datasheets (dense, no sparsity). For a CPU or an unknown
device the peak is either given explicitly or measured here with a short matmul calibration;
an unknown device never borrows another device's number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from titan_core.device import device_name

T = 1e12
# Dense peak TFLOP/s per dtype from vendor datasheets. "fp32" is plain (non-tensor-core) FP32;
# "tf32" is what fp32 matmuls reach with TF32 enabled.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "H20": {"bf16": 148.0, "fp16": 148.0, "fp8": 296.0, "tf32": 74.0, "fp32": 44.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0, "fp32": 75.0},
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "tf32": 1250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0, "fp32": 30.3},
    "MI355X": {"bf16": 2516.6, "fp16": 2516.6, "fp8": 5033.2, "tf32": 1258.3, "fp32": 157.3},
    "MI325X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}
# Longest names first so that "H100 NVL" wins over "H100" and "H200" over "H20".
_MATCH_ORDER = sorted(PEAK_TFLOPS, key=len, reverse=True)

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class PeakFlops:
    flops: float
    """Peak FLOP/s."""
    source: str
    """Where the number comes from: 'datasheet: H100', 'config', or 'measured: ...'."""


def lookup_peak_flops(name: str, dtype: str) -> float | None:
    """Datasheet peak for a device name such as torch.cuda.get_device_name() returns."""
    upper = name.upper()
    for key in _MATCH_ORDER:
        if key.upper() in upper:
            return PEAK_TFLOPS[key].get(dtype, 0.0) * T or None
    return None


def peak_flops(
    device: torch.device,
    dtype: torch.dtype | str,
    *,
    override_tflops: float | None = None,
    calibrate: bool = True,
) -> PeakFlops:
    """The peak to report MFU against: the explicit override, else the datasheet for a known
    GPU, else (CPU, unknown GPU) a measured matmul peak when `calibrate`, else an error."""
    key = dtype if isinstance(dtype, str) else _DTYPE_KEYS.get(dtype, str(dtype))
    if override_tflops is not None:
        if override_tflops <= 0:
            raise ValueError(f"peak TFLOP/s must be positive, got {override_tflops}")
        return PeakFlops(override_tflops * T, "config")
    name = device_name(device)
    if device.type != "cpu":
        if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
        known = lookup_peak_flops(name, key)
        if known:
            return PeakFlops(known, f"datasheet: {name} {key}")
    if not calibrate:
        raise ValueError(
            f"no datasheet peak for {name!r} in {key}; set metrics.peak_tflops, or allow a "
            "measured calibration"
        )
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(key)
    if torch_dtype is None:
        raise ValueError(f"cannot measure a peak for dtype {key!r}; set metrics.peak_tflops")
    measured = measure_matmul_flops(device, torch_dtype)
    return PeakFlops(measured, f"measured: {name} {key} matmul")


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, min_seconds: float = 0.5
) -> float:
    """Best FLOP/s of repeated square matmuls of `size` (a size that keeps the device busy:
    1024 on CPU, 8192 on GPUs), after a warm-up."""
    size = size or (1024 if device.type == "cpu" else 8192)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flop = 2 * size**3
    torch.matmul(a, b)  # warm-up: kernels, threads, caches
    _sync(device)
    best = 0.0
    spent = 0.0
    rounds = 0
    while spent < min_seconds or rounds < 3:
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        elapsed = time.perf_counter() - start
        spent += elapsed
        rounds += 1
        best = max(best, flop / elapsed)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
