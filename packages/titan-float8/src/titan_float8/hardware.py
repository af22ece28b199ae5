"""Whether this machine can run real Float8 matmuls.

"Real" means torchao calls `torch._scaled_mm` on Float8 operands; "emulated" means torchao
upcasts the Float8 operands and multiplies in high precision, which needs no Float8 hardware
and gives the same numerics up to accumulation order.

- CUDA: `_scaled_mm` needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); ROCm
  reports its own capability numbers and Float8-capable Instinct parts pass the same test.
- CPU: torch (2.15 included) ships a CPU `_scaled_mm` kernel, so real Float8 runs there, with
  Float8 rounding but no speed benefit. Builds without it fail the probe below.
"""

from __future__ import annotations

import torch

from titan_core.messages import first_line
from titan_float8.config import SECTION

MIN_CUDA_CAPABILITY = (8, 9)

_EMULATE_HINT = (
    f"set {SECTION} emulate = true (--quantize.linear.float8.emulate) to test Float8 numerics here"
)


def cuda_capability_problem(capability: tuple[int, int]) -> str | None:
    """The error for a CUDA device of this compute capability, or None if it has Float8."""
    if tuple(capability) >= MIN_CUDA_CAPABILITY:
        return None
    major, minor = capability
    need = ".".join(map(str, MIN_CUDA_CAPABILITY))
    return (
        f"Float8 training needs CUDA compute capability {need} or newer (H100, L4, RTX 4090, B200),"
        f" but this GPU has {major}.{minor}\n{_EMULATE_HINT}"
    )


def scaled_mm_problem(device: torch.device) -> str | None:
    """Try one tiny Float8 matmul on `device`; the error if it has no `_scaled_mm` kernel."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return (
            f"this torch {torch.__version__} build has no Float8 matmul (torch._scaled_mm) for "
            f"{device.type}: {first_line(e)}\n{_EMULATE_HINT}"
        )
    return None


def float8_hardware_problem(device: torch.device | str, emulate: bool) -> str | None:
    """Why real Float8 cannot run on `device` (None if it can, or if `emulate` is on)."""
    if emulate:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        problem = cuda_capability_problem(torch.cuda.get_device_capability(index))
        if problem:
            return problem
    return scaled_mm_problem(device)
