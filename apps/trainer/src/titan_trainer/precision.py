"""Which dtypes the run computes and reduces in: the one place the config's dtype names map to
torch dtypes."""

from __future__ import annotations

import torch

from titan_core import get_logger, supports_bf16

log = get_logger("precision")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""[training] mixed_precision_param / mixed_precision_reduce names -> torch dtypes."""


def compute_dtype(name: str, device: torch.device, params: str = "float32") -> torch.dtype:
    """The compute dtype for `training.mixed_precision_param` on `device`: bfloat16 where the
    device computes it natively (`auto`, `bfloat16`), float32 otherwise (with a warning when
    bfloat16 was asked for). Parameters kept in bfloat16 (`training.dtype`, `params`) compute
    in it on every device."""
    if params == "bfloat16":
        if not supports_bf16(device):
            log.warning(
                "training.dtype = bfloat16, but %s has no native bf16: it computes in"
                " bfloat16 anyway, slowly",
                device,
            )
        return torch.bfloat16
    if name == "float32":
        return torch.float32
    if supports_bf16(device):
        return torch.bfloat16
    if name == "bfloat16":
        log.warning(
            "training.mixed_precision_param = bfloat16, but %s has no native bf16; training in float32",
            device,
        )
    return torch.float32


def target_compute_dtype(name: str) -> torch.dtype:
    """The compute dtype on the GPUs a job is planned for (they all compute bfloat16)."""
    return torch.float32 if name == "float32" else torch.bfloat16


def cast_parameters_(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters of `module` to `dtype`, in place (the same Parameter objects,
    so tied ones stay tied); buffers keep theirs (rotary tables stay float32 or complex).
    Meant for the meta device, before parallelisation: FSDP, the optimizer and the
    checkpoints then see `dtype` only."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
