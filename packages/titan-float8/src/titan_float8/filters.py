"""Which nn.Linear layers become Float8: the name filter, the shape rule of the Float8 matmul,
and the "too small to pay off" thresholds.

Shapes use torchao's names: for `nn.Linear(in_features, out_features)` the weight is
[N, K] = [out_features, in_features], and the forward matmul is [M, K] @ [K, N] with M tokens.
"""

from __future__ import annotations

from torch import nn

from titan_float8.config import Float8

# Float8 matmuls (torch._scaled_mm) need K and N to be multiples of 16.
DIM_MULTIPLE = 16


def too_small_for_float8(recipe: str, n: int, k: int) -> bool:
    """Whether a linear with weight [N, K] is expected to run slower in Float8 than in bf16.

    The thresholds are torchao 0.18's own (`torchao.float8._auto_filter_for_recipe`), read off
    the forward+backward speed-up tables for each recipe in torchao's float8 README, measured
    on H100 with torch.compile. At these sizes the cost of computing scales and casting
    outweighs the faster matmul. torchao publishes no table for "rowwise_with_gw_hp"; it keeps
    one of the three matmuls in high precision, so it gains less than "rowwise", whose
    thresholds we apply to it as the nearest available estimate.
    """
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def skip_reason(module: nn.Module, fqn: str, section: Float8, tp_degree: int = 1) -> str | None:
    """Why this module stays as it is (None when it becomes a Float8Linear)."""
    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    matched = [name for name in section.filter_fqns if name in fqn]
    if matched:
        return f"filter_fqns {matched[0]!r}"
    n, k = module.weight.shape
    # Tensor parallel splits N (colwise) or K (rowwise) across the ranks; each shard must
    # still be a multiple of 16, and the plan is not known here, so both dims are checked.
    multiple = DIM_MULTIPLE * tp_degree
    if n % multiple or k % multiple:
        shard = f" (per tensor-parallel shard of {tp_degree})" if tp_degree > 1 else ""
        return f"N={n}, K={k} not multiples of {DIM_MULTIPLE}{shard}"
    if section.auto_filter_small_kn and too_small_for_float8(section.recipe, n, k):
        return (
            f"N={n}, K={k} too small for {section.recipe} Float8 to pay off (auto_filter_small_kn)"
        )
    return None
