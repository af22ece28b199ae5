"""Sliding-window and sink attention (`titan_models.local_attention`) in every mask
implementation, against the formula written out: scores, the mask, the sink column, softmax.

Tolerances (float32): 1e-5 on outputs and gradients (the kernels sum in other orders; a key
let in or shut out by a wrong window moves the result by ~1e-1, a sink left out by more)."""

from __future__ import annotations

import pytest
import torch

from titan_models.attention import attend, build_attention_mask
from titan_models.block_causal import attend_block_causal
from titan_models.local_attention import window_band

TOLERANCE = 1e-5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def reference(q, k, v, ids, window, sinks):
    """Attention written out in float32: the block-causal-and-window mask, the sink as one
    more column of the softmax, dropped after it."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    positions = torch.arange(q.shape[2])
    allowed = window_band(positions, positions, window)[None] & (ids[:, :, None] == ids[:, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v


def _ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    return torch.stack(rows)


PACKINGS = {
    "one document": [[40], [40]],
    "documents": [[7, 1, 20, 12], [3, 37]],
}


def _inputs(batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, generator=g)
    k = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, generator=g)
    v = torch.randn(batch, KV_HEADS, seq, HEAD_DIM, generator=g)
    sinks = torch.randn(HEADS, generator=g)
    return q, k, v, sinks


def _run(fn, q, k, v, sinks, backward: bool):
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v, sinks)]
    out = fn(*leaves)
    if not backward:
        return [out]
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()
    return [out] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("window", [None, 1, 5, 16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("impl", ["dense", "varlen", "flex"])
def test_each_implementation_equals_the_formula(packing, window, with_sinks, impl):
    ids = _ids(PACKINGS[packing])
    q, k, v, sinks = _inputs(*ids.shape)
    backward = impl != "flex"  # the CPU has no FlexAttention backward (torch 2.11-2.15)
    mask = build_attention_mask(ids, impl=impl, windows=(1, 5, 16))

    def ours(q, k, v, s):
        return attend_block_causal(q, k, v, mask, window=window, sinks=s if with_sinks else None)

    def theirs(q, k, v, s):
        return reference(q, k, v, ids, window, s if with_sinks else None)

    got = _run(ours, q, k, v, sinks, backward)
    want = _run(theirs, q, k, v, sinks, backward)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, want, strict=False):
        error = (a - b).abs().max().item()
        assert error < TOLERANCE, f"{impl} window {window} sinks {with_sinks} {name}: {error:.2e}"


def test_the_window_and_the_sinks_change_the_result():
    # The cases above would pass for code that ignored both if they changed nothing.
    ids = _ids(PACKINGS["one document"])
    q, k, v, sinks = _inputs(*ids.shape)
    plain = reference(q, k, v, ids, None, None)
    assert (reference(q, k, v, ids, 5, None) - plain).abs().max() > 0.1
    assert (reference(q, k, v, ids, None, sinks) - plain).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 6])
def test_without_a_mask_the_window_and_sinks_apply_causally(window):
    q, k, v, sinks = _inputs(2, 24)
    ids = torch.zeros(2, 24, dtype=torch.long)
    got = attend(q, k, v, None, window=window, sinks=sinks)
    want = reference(q, k, v, ids, window, sinks)
    assert (got - want).abs().max() < TOLERANCE


def test_a_window_the_flex_mask_was_not_built_for_is_named():
    ids = _ids(PACKINGS["one document"])
    q, k, v, _ = _inputs(*ids.shape)
    mask = build_attention_mask(ids, impl="flex", windows=(4,))
    with pytest.raises(ValueError, match=r"built for the windows \[4\].*window 8"):
        attend_block_causal(q, k, v, mask, window=8)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["flex", "varlen", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_equal_the_formula(impl, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ids = _ids([[300, 212], [17, 480, 15]]).cuda()
    q, k, v, sinks = (t.cuda() for t in _inputs(*ids.shape))
    tolerance = 2e-3 if dtype == torch.float32 else 3e-2  # TF32 / bf16 roundings
    mask = build_attention_mask(ids, impl=impl, windows=(128,))
    for window in (None, 128):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        out = attend_block_causal(*leaves[:3], mask, window=window, sinks=leaves[3])
        ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
        ref = reference(*ref_leaves[:3], ids, window, ref_leaves[3])
        weights = torch.randn_like(ref)
        (out.float() * weights).sum().backward()
        (ref * weights).sum().backward()
        pairs = [(out.float(), ref)] + [
            (a.grad.float(), b.grad) for a, b in zip(leaves, ref_leaves)
        ]
        for got, want in pairs:
            assert (got - want).abs().max() <= tolerance * want.abs().max()
