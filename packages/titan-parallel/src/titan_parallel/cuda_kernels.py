"""What CUDA kernels keep for backward, on the CPU: for memory estimates of GPU jobs made on a
CPU.

A simulation on CPU fake tensors runs the CPU kernels. Where a CUDA kernel saves less for
backward than its CPU counterpart, the estimate of a GPU job would be too high. Inside
`cuda_kernels()` such operators run as the CUDA kernel does, memory-wise (same results):

- `rms_norm`: one fused CUDA kernel (torch >= 2.9) that saves its input and the reciprocal
  RMS (one float32 per row). On the CPU it is composed of element-wise operations, and autograd
  keeps float32 copies of the input and of the normalised input: at Llama 3 8B's width and
  seq 8192, 256 MiB per norm instead of nothing beyond the input.

- activation offload (`titan_parallel.activation_offload`): the copies it makes to the host
  are host memory, not the GPU's: left out of the count (their bytes are reported apart).

Compiled regions are left alone: there inductor's decompositions are the same on every device
(see `titan_parallel.compiled_memory`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from titan_parallel.activation_offload import host_memory_separate


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Run operators whose CUDA kernels save less for backward as those kernels do (see the
    module docstring). Not thread-safe: it swaps `torch.rms_norm` for the process.

    A swap rather than a TorchFunctionMode: a mode is not active while autograd recomputes a
    checkpointed region during backward, so the recompute would run the CPU composition and
    no longer match what the forward saved (selective checkpointing refuses that)."""
    original = torch.rms_norm

    def rms_norm(input, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling():  # inductor's decomposition is the same everywhere
            return original(input, normalized_shape, weight, eps)
        return _rms_norm(input, normalized_shape, weight, eps)

    torch.rms_norm = rms_norm  # F.rms_norm (nn.RMSNorm) calls it by this name
    try:
        with host_memory_separate():
            yield
    finally:
        torch.rms_norm = original


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    if eps is None:
        eps = torch.finfo(input.dtype).eps
    return _FusedRMSNorm.apply(input, tuple(normalized_shape), weight, eps)


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that saves only its input, its weight and the reciprocal RMS per row."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(wide.pow(2).mean(dims, keepdim=True) + eps)
        out = wide * rstd
        if weight is not None:
            out = out * weight
        ctx.dims = dims
        ctx.save_for_backward(x, weight, rstd)
        return out.to(x.dtype)  # as aten's rms_norm: the input's dtype

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dims = ctx.dims
        normed = x.to(rstd.dtype) * rstd
        grad = grad.to(rstd.dtype)
        grad_normed = grad * weight if weight is not None else grad
        grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(dims, keepdim=True))
        grad_weight = None
        if weight is not None and ctx.needs_input_grad[2]:
            outer = tuple(range(grad.dim() - len(dims)))
            grad_weight = (grad * normed).sum(outer).to(weight.dtype)
        return grad_x.to(x.dtype), None, grad_weight, None
