"""Ranger21's step as three fused kernels per parameter (`Ranger21(compiled=True)`).

The eager step is a sequence of foreach operations, each a full pass over the parameters, the
gradients or a moment: about twice the memory traffic of AdamW. The same formulas written per
parameter and compiled by torch.compile (inductor) become three loops that each read what they
need once:

1. `unit_stats`: per unit (row) of a parameter, the sums of w^2, g^2 and g (for clipping,
   centralization and norm loss), in one pass over w and g;
2. `second_moment_adamw` / `second_moment_madgrad`: the clipped, centralized gradient written
   back, the second moment (and MADGRAD's first sum) updated, and its sums per unit returned
   (for stable weight decay);
3. `adamw_update` / `madgrad_update`: the decay and norm loss, the momentum, the denominator
   (softplus) and the parameter update.

The statistics between the kernels (per-row factors, the model-wide mean) are reduced across
ranks by the optimizer, exactly as in the eager step. Scalars that change from step to step
(learning rate, bias corrections) are passed as 0-dim tensors so that a new value does not
recompile; shapes are dynamic, so one graph serves every parameter of a rank.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def unit_stats(w: Tensor, g: Tensor) -> Tensor:
    """[3, units]: sums of w^2, g^2 and g over each unit (float32)."""
    w, g = w.float(), g.float()
    if w.ndim > 1:
        dims = tuple(range(1, w.ndim))
        return torch.stack([(w * w).sum(dims), (g * g).sum(dims), g.sum(dims)])
    return torch.stack([(w * w).sum(), (g * g).sum(), g.sum()]).reshape(3, 1)


def _unit_sums(x: Tensor) -> Tensor:
    # Sums along rows vectorise in inductor's CPU code; one sum over a whole large tensor
    # was measured 4x slower than the rest of its kernel. The caller adds the rows up.
    return x.sum(tuple(range(1, x.ndim))) if x.ndim > 1 else x.sum().reshape(1)


def second_moment_adamw(
    g: Tensor, v: Tensor, scale: Tensor | None, shift: Tensor | None, b2: Tensor
) -> Tensor:
    """g <- g * scale - shift (clipping and centralization); v <- b2 v + (1 - b2) g^2;
    returns the sums of v per unit."""
    if scale is not None:
        g.copy_(g * scale.to(g.dtype))
    if shift is not None:
        g.copy_(g - shift.to(g.dtype))
    gf = g.float()
    v_new = v * b2 + gf * gf * (1 - b2)
    v.copy_(v_new)
    return _unit_sums(v_new)


def second_moment_madgrad(
    g: Tensor,
    s: Tensor,
    big_s: Tensor,
    scale: Tensor | None,
    shift: Tensor | None,
    lamb: Tensor,
) -> Tensor:
    """g <- g * scale - shift; MADGRAD's dual averages s += lamb g, S += lamb g^2; returns
    the sums of S per unit."""
    if scale is not None:
        g.copy_(g * scale.to(g.dtype))
    if shift is not None:
        g.copy_(g - shift.to(g.dtype))
    gf = g.float()
    s.copy_(s + gf * lamb)
    big_s_new = big_s + gf * gf * lamb
    big_s.copy_(big_s_new)
    return _unit_sums(big_s_new)


def adamw_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    m_other: Tensor | None,
    v: Tensor,
    factor: Tensor | None,
    b1: Tensor,
    c_current: Tensor,
    c_other: Tensor,
    bias2_sqrt: Tensor,
    eps: Tensor,
    step_size: Tensor,
    softplus_beta: float | None,
) -> None:
    """p <- p * factor (decay and norm loss), then the Adam step with positive-negative
    momentum when `m_other` is given (b1 is then b1^2):
    m <- b1 m + (1 - b1) g; update = c_current m - c_other m_other (or m);
    denom = softplus(sqrt(v) / bias2_sqrt + eps); p <- p - step_size update / denom."""
    pf = p.float()
    if factor is not None:
        pf = pf * factor
    if m_other is None:  # Adam's momentum, as the eager step computes it (a lerp)
        m_new = torch.lerp(m, g.float(), 1 - b1)
    else:
        m_new = m * b1 + g.float() * (1 - b1)
    m.copy_(m_new)
    update = m_new * c_current - m_other * c_other if m_other is not None else m_new
    denom = torch.sqrt(v) / bias2_sqrt + eps
    if softplus_beta is not None:
        denom = F.softplus(denom, beta=softplus_beta)
    p.copy_(pf - update / denom * step_size)


def madgrad_update(
    p: Tensor,
    s: Tensor,
    big_s: Tensor,
    x0: Tensor,
    factor: Tensor | None,
    eps: Tensor,
    c: Tensor,
    softplus_beta: float | None,
) -> None:
    """p <- p * factor, then MADGRAD's p <- (1 - c) p + c (x0 - s / (S^(1/3) + eps))."""
    pf = p.float()
    if factor is not None:
        pf = pf * factor
    rms = big_s.pow(1 / 3) + eps
    if softplus_beta is not None:
        rms = F.softplus(rms, beta=softplus_beta)
    z = x0.float() - s / rms
    p.copy_(pf + (z - pf) * c)


# One graph per kind of parameter (1-D or 2-D, dtype, which components are on): a model has
# a handful, a process that builds several optimizers (tests, comparisons) more than dynamo's
# default limit of 8 per function; past the limit a fullgraph compile raises.
_RECOMPILE_LIMIT = 64


@functools.cache
def compiled(name: str):
    """The kernel `name` compiled once per process (inductor; dynamic shapes)."""
    fn = torch.compile(globals()[name], dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def call(*args):
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return fn(*args)

    return call
