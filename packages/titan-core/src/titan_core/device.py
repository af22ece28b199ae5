"""Which device this process computes on, and which collective backend goes with it."""

from __future__ import annotations

import os

import torch

BACKENDS = {"cuda": "nccl", "cpu": "gloo", "xpu": "xccl"}


def resolve_device_type(requested: str = "auto") -> str:
    """`auto` is cuda when a CUDA device is visible, else cpu. Asking for a device that is not
    there is an error, not a silent fallback."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "job.device = cuda, but no CUDA device is visible to this process; "
            "use --job.device cpu (or auto) to run on the CPU"
        )
    if requested not in BACKENDS:
        raise ValueError(f"unknown device type {requested!r}; known: auto, {', '.join(BACKENDS)}")
    return requested


def backend_for(device_type: str) -> str:
    """nccl for CUDA, gloo for CPU."""
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"no collective backend known for device type {device_type!r}") from None


def process_group_backend(device_type: str) -> str:
    """The backend of the default process group for `device_type`, as torch's
    `init_process_group` takes it: gloo on CPU; on an accelerator its own collective backend
    with gloo beside it for CPU tensors (`cuda:nccl,cpu:gloo`). DCP's async save stages the
    state in CPU memory and refuses a group without a CPU backend, and collectives of Python
    objects or CPU tensors need one too; the accelerator's tensors still go through NCCL."""
    backend = backend_for(device_type)
    if device_type == "cpu":
        return backend
    return f"{device_type}:{backend},cpu:gloo"


def local_device(device_type: str) -> torch.device:
    """This process's device: cuda:LOCAL_RANK under torchrun, else the device type itself."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    module = getattr(torch, device_type)
    module.set_device(index)
    return torch.device(device_type, index)


def device_name(device: torch.device) -> str:
    """A human-readable name of the device ("NVIDIA H100 80GB HBM3", "cpu: <model name>")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return "cpu: " + line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "cpu"
    return device.type


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 compute is native here: CUDA with bf16 support, or a CPU with bf16
    instructions (AVX-512 BF16 or AMX) that torch's kernels dispatch to. The CPU's instructions
    are read by torch's cpuinfo (`torch.cpu._is_avx512_bf16_supported`), and torch's dispatch
    level by `torch.backends.cpu.get_cpu_capability()`: with `ATEN_CPU_CAPABILITY=avx2` torch
    computes as on an AVX2-only CPU, and so does this (how CI checks an AVX2-only machine)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX"):
        return False
    avx512_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if avx512_bf16 is not None and amx is not None:
        return avx512_bf16() or amx()
    try:  # a torch without these probes: the kernel's flags, on Linux
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Memory per device as torch reports it (GiB), for devices a job may target. A dry run on a
# laptop names its target by these names; longest match wins ("H100 NVL" before "H100").
DEVICE_MEMORY_GIB: dict[str, float] = {
    "H100 NVL": 93.1,
    "H100 PCIe": 79.2,
    "H100": 79.2,  # SXM 80 GB
    "H200": 139.8,
    "H20": 95.0,
    "B200": 178.4,
    "GB200": 184.0,
    "A100-40GB": 39.4,
    "A100": 79.2,  # 80 GB
    "A10G": 22.1,
    "L40S": 44.4,
    "L4": 22.0,
    "MI300X": 191.5,
    "MI325X": 255.5,
    "MI355X": 287.6,
}


def device_memory_gib(name: str) -> float | None:
    """Usable memory of a device named like `torch.cuda.get_device_name()` ("NVIDIA H100 80GB
    HBM3") or a short name ("H100", "A100-40GB"); None for an unknown name."""
    upper = name.upper().replace(" ", "")
    if "A100" in upper and "40GB" in upper:
        return DEVICE_MEMORY_GIB["A100-40GB"]
    for key in sorted(DEVICE_MEMORY_GIB, key=len, reverse=True):
        if key.upper().replace(" ", "") in upper:
            return DEVICE_MEMORY_GIB[key]
    return None
