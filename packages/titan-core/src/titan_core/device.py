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
    """Whether bf16 compute is native here (CUDA with bf16 support, or a CPU with bf16 instructions)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:  # not Linux: ask torch which vector ISA it dispatches to
            return "AMX" in torch.backends.cpu.get_cpu_capability().upper()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False
