"""QK-Clip (titan_parallel.qk_clip): after the clip each head that went over tau has tau as its
largest logit on the same inputs and every other head keeps its logits, for grouped-query and
latent-attention layouts; the step equals one process's under FSDP2 and TP2 (2 gloo ranks)."""

from __future__ import annotations

import math

import pytest
import torch
from qk_clip_testmodel import TinyModel

from titan_parallel import QKClip, max_logits

TAU = 5.0


def _inputs(model: TinyModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """What each attention layer read in a forward of `tokens`."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
        for layer in model.layers
    ]
    model(tokens)
    for h in hooks:
        h.remove()
    return seen


def _per_head(model: TinyModel, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        max_logits(*layer.qk(x), layer.qk_clip_layout().scale)
        for layer, x in zip(model.layers, inputs)
    ]


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_heads_over_tau_land_on_tau_and_the_others_keep_their_logits(kind):
    torch.manual_seed(0)
    model = TinyModel(kind)
    with torch.no_grad():  # sharp heads, and some under tau: the first query head of each layer
        for layer in model.layers:
            query, key = layer.qk_clip_layout().rows
            key.weight.mul_(3.0)
            query.weight.mul_(3.0)
            query.weight[: sum(n for _, n in query.parts)].mul_(0.05)
    clip = QKClip([model], TAU)
    tokens = torch.randint(0, 64, (3, 16))
    inputs = _inputs(model, tokens)
    before = _per_head(model, inputs)
    over = torch.cat(before) > TAU
    assert over.any() and not over.all(), before  # both kinds of head are there
    top = clip.clip_()
    assert top.item() == pytest.approx(max(b.max().item() for b in before), rel=1e-6)
    after = _per_head(model, inputs)
    for b, a in zip(before, after):
        expected = torch.where(b > TAU, torch.full_like(b, TAU), b)
        # float32 logits recomputed from the scaled weights: rounding of a few ulps
        torch.testing.assert_close(a, expected, rtol=1e-4, atol=0)
    # The records start afresh: with no forward since, a clip finds nothing and changes nothing.
    weights = [p.detach().clone() for p in model.parameters()]
    assert clip.clip_().item() == -math.inf
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_gqa_rule_keeps_an_under_tau_heads_logits_when_its_kv_head_shrinks():
    torch.manual_seed(1)
    model = TinyModel("gqa")
    layer = model.layers[0]
    with torch.no_grad():  # query head 0 sharp, head 1 (same kv head) mild
        layer.wq.weight[:8].mul_(20.0)
    clip = QKClip([model], TAU)
    inputs = _inputs(model, torch.randint(0, 64, (2, 16)))
    before = _per_head(model, inputs)[0]
    assert before[0] > TAU > before[1]
    wk_before = layer.wk.weight.detach().clone()
    clip.clip_()
    after = _per_head(model, inputs)[0]
    assert after[0].item() == pytest.approx(TAU, rel=1e-4)
    assert after[1].item() == pytest.approx(before[1].item(), rel=1e-4)
    gamma = TAU / before[0].item()
    # kv head 0 shrinks by sqrt(gamma); query head 1's rows grow by 1 / sqrt(gamma)
    assert torch.allclose(layer.wk.weight[:8], wk_before[:8] * math.sqrt(gamma), rtol=1e-6)
    assert torch.equal(layer.wk.weight[8:], wk_before[8:])  # kv head 1: no head over tau


def test_tau_must_be_positive():
    with pytest.raises(ValueError, match="tau"):
        QKClip([TinyModel()], 0.0)


def test_without_tau_it_records_the_largest_logit_and_scales_nothing():
    torch.manual_seed(0)
    model = TinyModel("gqa")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # logits well over TAU: a clip would scale
    monitor = QKClip([model], None)
    tokens = torch.randint(0, 64, (3, 16))
    expected = max(b.max().item() for b in _per_head(model, _inputs(model, tokens)))
    assert expected > TAU
    weights = [p.detach().clone() for p in model.parameters()]
    assert monitor.clip_().item() == pytest.approx(expected, rel=1e-6)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


DISTRIBUTED = [("gqa", "fsdp2"), ("mla", "fsdp2"), ("gqa", "tp2")]


def test_fsdp2_and_tp2_clip_the_weights_one_process_clips(tmp_path):
    from qk_clip_worker import TAU, run_ranks, train

    results = run_ranks(2, DISTRIBUTED, str(tmp_path))
    for kind, layout in DISTRIBUTED:
        one, got = train(kind), results[f"{kind}_{layout}"]
        assert max(one["logits"]) > TAU  # the clip had work on the way
        # Gradients summed in another order (FSDP2's reduce-scatter, TP's partial sums) and
        # Newton-Schulz in float32: weights within 1e-5, the same maxima to 1e-5 relative.
        assert got["logits"] == pytest.approx(one["logits"], rel=1e-5), (kind, layout)
        for name, value in one["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-5)


def test_a_sliding_window_limits_the_pairs_whose_logits_count():
    from titan_parallel.qk_clip import max_logits

    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 12, 8, generator=g)
    k = torch.randn(1, 2, 12, 8, generator=g)
    k[:, :, 0] *= 50  # a key far back, which only the full window sees
    full = max_logits(q, k, 1.0)
    windowed = max_logits(q, k, 1.0, window=4)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k)
    rows, cols = torch.arange(12)[:, None], torch.arange(12)[None]
    allowed = (cols <= rows) & (rows - cols < 4)
    expected = logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(windowed, expected)
    assert (full >= windowed).all() and (full > windowed + 1).any()
