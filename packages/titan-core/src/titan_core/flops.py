"""Peak FLOP/s of the device, the denominator of MFU.

Known accelerators come from their datasheets (dense, no sparsity). For a CPU or an unknown
device the peak is either given explicitly or measured here; an unknown device never borrows
another device's number.

A measurement on a shared machine is only as good as its least disturbed moment: other
processes slow most samples down, never speed one up. So the peak is the fastest of many short
matmuls, not an average, and never lower than the best this machine showed before (cached per
machine in the user's cache folder, keyed by CPU model and flags or GPU name, torch version,
dtype and threads). On a CPU it is also compared with a bound computed from the vector width,
FMA and core count that the CPU reports, which catches a measurement still far too low.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_core.device import device_name
from titan_core.log import get_logger

log = get_logger("flops")

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
_TORCH_DTYPES = {v: k for k, v in _DTYPE_KEYS.items()}

# A measured peak under this share of the CPU's bound was almost surely slowed by other work.
SUSPECT_SHARE_OF_BOUND = 0.25


def two_significant(x: float) -> str:
    """`x` with two significant figures and no exponent: 0.043, 0.17, 1.5, 990."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = 1 - math.floor(math.log10(abs(x)))
    rounded = round(x, digits)
    if rounded and math.floor(math.log10(abs(rounded))) != math.floor(math.log10(abs(x))):
        digits -= 1  # 0.0996 rounds up to 0.10, which has one leading digit fewer
    return f"{round(x, digits):.{max(digits, 0)}f}"


@dataclass(frozen=True)
class PeakFlops:
    flops: float
    """Peak FLOP/s."""
    source: str
    """Where the number comes from: 'datasheet: H100', 'config', or 'measured: ...'."""

    def describe(self) -> str:
        """`0.17 TFLOP/s (measured: ...)`: two significant figures, whatever the size."""
        return f"{two_significant(self.flops / T)} TFLOP/s ({self.source})"


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
    cache: bool = True,
) -> PeakFlops:
    """The peak to report MFU against: the explicit override, else the datasheet for a known
    GPU, else (CPU, unknown GPU) a measured matmul peak when `calibrate`, else an error.

    The measurement uses a private random generator, so the global RNG (a resumed run's,
    say) is the same before and after. With `cache`, the best peak measured on this machine is
    kept in `peak_cache_file()` and a lower measurement never replaces it.
    """
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
    torch_dtype = _TORCH_DTYPES.get(key)
    if torch_dtype is None:
        raise ValueError(f"cannot measure a peak for dtype {key!r}; set metrics.peak_tflops")
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    measured = measure_matmul_flops(device, torch_dtype)
    best = measured
    where = f"{threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else name
    source = f"measured: {name}, {key} matmul, {where}"
    if cache:
        entry = machine_key(device, key, threads)
        before = read_cached_peak(entry)
        if before is not None and before > measured:
            best = before
            source += f", best on this machine (this run {two_significant(measured / T)})"
        else:
            store_cached_peak(entry, measured)
    if device.type == "cpu":
        bound = cpu_peak_bound(key, threads)
        if bound is not None:
            source += f"; CPU bound {two_significant(bound.flops / T)}"
            problem = suspect_peak(best, bound)
            if problem:
                log.warning(problem)
    return PeakFlops(best, source)


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    size: int | None = None,
    min_seconds: float = 0.5,
    min_samples: int = 10,
) -> float:
    """The fastest of repeated square matmuls, after a warm-up: at least `min_samples` of them
    and `min_seconds` in all. Without `size`, the size doubles from 256 until one matmul takes
    a millisecond or more (8192 on GPUs): short enough that some samples run undisturbed on a
    shared machine, long enough to keep every core busy. The operands come from a private
    generator: the global RNG state is untouched."""
    generator = torch.Generator(device=device).manual_seed(0)

    def operands(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(
            torch.randn(n, n, device=device, dtype=dtype, generator=generator) for _ in range(2)
        )

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        return time.perf_counter() - start

    if size is None:
        size = 8192 if device.type != "cpu" else 256
        while device.type == "cpu" and size < 4096:
            a, b = operands(size)
            timed(a, b)  # warm-up: kernels, threads, caches
            if min(timed(a, b) for _ in range(2)) >= 0.001:
                break
            size *= 2
    a, b = operands(size)
    timed(a, b)
    flop = 2 * size**3
    best = 0.0
    deadline = time.perf_counter() + min_seconds
    samples = 0
    while samples < min_samples or time.perf_counter() < deadline:
        best = max(best, flop / timed(a, b))
        samples += 1
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def suspect_peak(flops: float, bound: CpuBound) -> str | None:
    """A warning when a measured peak is far below the CPU's bound, else None."""
    if flops >= SUSPECT_SHARE_OF_BOUND * bound.flops:
        return None
    return (
        f"the measured peak, {two_significant(flops / T)} TFLOP/s, is under "
        f"{round(100 * SUSPECT_SHARE_OF_BOUND)}% of what this CPU can do "
        f"({two_significant(bound.flops / T)} TFLOP/s: {bound.detail}): other work on the "
        "machine probably slowed the measurement, and MFU will read too high. Run again on a "
        "quieter machine (the best measurement is kept) or set --metrics.peak_tflops"
    )


# --- the per-machine cache of the best measurement -----------------------------------------


def peak_cache_file() -> Path:
    """Where measured peaks are kept: `$TITAN_CACHE_DIR`, else `$XDG_CACHE_HOME/titan`, else
    `~/.cache/titan`, file `peak_flops.json`. Delete it to measure from scratch."""
    folder = os.environ.get("TITAN_CACHE_DIR")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "titan")
    return Path(folder) / "peak_flops.json"


def machine_key(device: torch.device, dtype: str, threads: int) -> str:
    """What a measured peak depends on: the device model (and a CPU's instruction-set flags),
    the torch version, the dtype and the thread count."""
    if device.type == "cpu":
        flags = " ".join(sorted(_cpu_flags(_read_text("/proc/cpuinfo"))))
        flags = flags or torch.backends.cpu.get_cpu_capability()
        what = f"{device_name(device)} [{hashlib.sha1(flags.encode()).hexdigest()[:12]}]"
    else:
        what = device_name(device)
    return f"{what} | torch {torch.__version__} | {dtype} | {threads} threads"


def read_cached_peak(key: str) -> float | None:
    value = _read_cache().get(key)
    return float(value) if isinstance(value, int | float) and value > 0 else None


def store_cached_peak(key: str, flops: float) -> None:
    """Record `flops` for `key`, atomically; a cache that cannot be written only costs the
    next run a fresh measurement."""
    path = peak_cache_file()
    entries = _read_cache()
    before = entries.get(key)
    entries[key] = max(flops, before if isinstance(before, int | float) else 0.0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not write the peak cache %s: %s", path, e)


def _read_cache() -> dict:
    try:
        entries = json.loads(peak_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


# --- a bound from what the CPU reports -----------------------------------------------------


@dataclass(frozen=True)
class CpuBound:
    flops: float
    """FLOP/s the cores could do if every cycle were a full-width FMA on every unit."""
    detail: str
    """How it was computed: `2 cores x 2.4 GHz x 32 fp32 FLOP/cycle (AVX2, FMA)`."""


# At most two vector FMA units per core on the CPUs PyTorch runs on: an upper bound.
_FMA_UNITS = 2
# AMX multiplies 16x32 bf16 (or fp16) tiles: 1024 FLOP per cycle per core.
_AMX_FLOP_PER_CYCLE = 1024


def cpu_peak_bound(
    dtype: str,
    threads: int,
    cpuinfo: str | None = None,
    max_mhz: float | None = None,
    cpus: int | None = None,
) -> CpuBound | None:
    """Peak FLOP/s of `threads` cores from the vector width, FMA and matrix units that the CPU
    reports (x86 flags or Arm features in /proc/cpuinfo) and its clock; None when any of them
    cannot be read. Every unit is detected, none assumed: AVX-512 counts only when `avx512f`
    is listed. The clock is the highest one the system reports (cpufreq's maximum, else the
    `@ x GHz` of the model name, else `cpu MHz`); in a VM that may be the base clock, so the
    bound can sit below what turbo reaches.

    `cpuinfo` (the text of a /proc/cpuinfo), `max_mhz` and `cpus` (usable logical CPUs)
    describe another machine; with `cpuinfo` given, nothing is read from this one.
    """
    here = cpuinfo is None
    text = _read_text("/proc/cpuinfo") if here else cpuinfo
    flags = _cpu_flags(text)
    if not flags:
        return None
    if "avx512f" in flags:
        bits, isa = 512, "AVX-512"
    elif "avx" in flags:
        bits, isa = 256, "AVX2" if "avx2" in flags else "AVX"
    elif "asimd" in flags and "sve" not in flags:  # SVE's width is not in /proc/cpuinfo
        bits, isa = 128, "NEON"
    elif "sse2" in flags:
        bits, isa = 128, "SSE2"
    else:
        return None
    fma = "fma" in flags or isa == "NEON"  # every Armv8 core has vector FMA
    per_cycle = (bits // 32) * (2 if fma else 1) * _FMA_UNITS
    notes = [isa] + (["FMA"] if fma else [])
    if dtype in ("bf16", "fp16"):
        half = "bf16" if dtype == "bf16" else "fp16"
        if f"amx_{half}" in flags:
            per_cycle, notes = _AMX_FLOP_PER_CYCLE, [f"AMX {half}"]
        elif f"avx512_{half}" in flags:
            per_cycle, notes = per_cycle * 2, [*notes, f"avx512_{half}"]
    elif dtype != "fp32":
        return None
    if max_mhz is not None:
        clock = (max_mhz, "given")
    else:
        sysfs = _read_text("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") if here else ""
        clock = cpu_clock_mhz(text, sysfs)
    if clock is None:
        return None
    mhz, clock_source = clock
    if cpus is None and here:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    elif cpus is None:
        cpus = len(re.findall(r"^processor\s*:", text, flags=re.M))
    cores = _physical_cores(text, cpus)
    used = min(threads, cores)
    return CpuBound(
        used * mhz * 1e6 * per_cycle,
        f"{used} core{'s' if used > 1 else ''} x {mhz / 1000:.1f} GHz ({clock_source}) x "
        f"{per_cycle} {dtype} FLOP/cycle ({', '.join(notes)})",
    )


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cpuinfo_field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def _cpu_flags(text: str) -> set[str]:
    return set((_cpuinfo_field(text, "flags") or _cpuinfo_field(text, "Features") or "").split())


def cpu_clock_mhz(cpuinfo: str, cpufreq_max_khz: str = "") -> tuple[float, str] | None:
    """The highest clock the system reports, and which figure it is: cpufreq's maximum (kHz),
    else the model name's `@ x GHz` (nominal), else /proc/cpuinfo's `cpu MHz`."""
    try:
        return float(cpufreq_max_khz) / 1000, "maximum"
    except ValueError:
        pass
    match = re.search(r"@\s*([\d.]+)\s*GHz", _cpuinfo_field(cpuinfo, "model name") or "")
    if match:
        return float(match.group(1)) * 1000, "nominal"
    try:
        return float(_cpuinfo_field(cpuinfo, "cpu MHz") or ""), "reported"
    except ValueError:
        return None


def _physical_cores(text: str, cpus: int) -> int:
    """Cores among `cpus` logical CPUs, counting a core's hyperthreads once."""
    try:
        per_core = int(_cpuinfo_field(text, "siblings")) // int(_cpuinfo_field(text, "cpu cores"))
    except (TypeError, ValueError, ZeroDivisionError):
        per_core = 1
    return max(1, (cpus or 1) // max(per_core, 1))
