"""The training-only balanced expert choice of `titan_models.moe.router`: Sinkhorn selection
and the expert capacity, against plain top-k on tokens that make top-k collapse, in float32
on CPU. Tokens that differ in many directions are spread by Sinkhorn alone; tokens that vary
along one direction (what the debug models' routers see at lr 3e-3) need the capacity, which
is also causal (first come, first served along the sequence)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_models.moe import MoE, MoEArgs
from titan_models.moe.router import sinkhorn_offsets, top_k_within_capacity

DIM, SEQS, SEQ = 32, 4, 64


def _router(seed: int = 0, **kw):
    torch.manual_seed(seed)
    args = MoEArgs(
        **{"num_experts": 8, "top_k": 2, "hidden_dim": 16, "load_balance_coeff": None, **kw}
    )
    layer = MoE(DIM, args)
    torch.nn.init.normal_(layer.router.gate.weight, std=0.3)
    return layer.router


def _spread(experts: torch.Tensor, num_experts: int = 8) -> float:
    """The worst sequence's max/mean tokens per expert."""
    worst = 0.0
    for seq in experts.view(SEQS, -1):
        counts = torch.bincount(seq, minlength=num_experts).float()
        worst = max(worst, (counts.max() / counts.mean()).item())
    return worst


def _alike_tokens(low_rank: bool) -> torch.Tensor:
    """Tokens nearly parallel to one direction: the rest noise in every direction, or (low
    rank) a scalar times one other direction."""
    torch.manual_seed(1)
    common = torch.randn(DIM) * 3
    if low_rank:
        return common + torch.randn(SEQS * SEQ, 1) * 0.05 * torch.randn(DIM)
    return common + 0.05 * torch.randn(SEQS * SEQ, DIM)


def _experts(router, tokens) -> torch.Tensor:
    with torch.no_grad():
        return router(tokens, None, SEQS)[1]


def test_sinkhorn_spreads_nearly_alike_tokens_that_top_k_sends_to_one_expert():
    tokens = _alike_tokens(low_rank=False)
    topk = _spread(_experts(_router(), tokens))
    sinkhorn = _spread(_experts(_router(router_selection="sinkhorn"), tokens))
    assert topk == 4.0, topk  # 8 experts, top-2: every token on the same two
    assert sinkhorn <= 1.5, sinkhorn


def test_the_capacity_holds_where_sinkhorn_alone_cannot():
    """Tokens varying along one direction reach only a few experts' top-k however the experts
    are offset (why the debug flavors add the capacity): capacity 1.25 caps every expert at
    ceil(1.25 x 16) = 20 of a sequence's 128 choices, i.e. max/mean 1.25."""
    tokens = _alike_tokens(low_rank=True)
    sinkhorn = _spread(_experts(_router(router_selection="sinkhorn"), tokens))
    capped = _experts(_router(router_selection="sinkhorn", capacity_factor=1.25), tokens)
    assert sinkhorn > 1.5, sinkhorn
    assert _spread(capped) <= 1.25, _spread(capped)
    assert (capped[:, 0] != capped[:, 1]).all()  # still two different experts per token
    topk_capped = _experts(_router(capacity_factor=1.25), tokens)
    assert _spread(topk_capped) <= 1.25, _spread(topk_capped)


def test_capacity_is_first_come_first_served_and_causal():
    """Where there is room every token keeps its top-k; where not, a token is moved off its
    first choice only because the tokens before it filled that expert; and changing a later
    token never changes an earlier token's experts."""
    torch.manual_seed(3)
    choice = torch.randn(3, 40, 8)
    roomy = top_k_within_capacity(choice, 2, capacity=80)
    assert torch.equal(roomy.sort(-1).values, choice.topk(2, -1).indices.sort(-1).values)
    tight = top_k_within_capacity(choice, 2, capacity=12)  # 80 choices, 8 experts: 1.2 x 10
    for seq, ranks in zip(tight, choice):
        assert torch.bincount(seq.flatten(), minlength=8).max() <= 12
        assert (seq[:, 0] != seq[:, 1]).all()
        for t in (~(seq == ranks[:, None].argmax(-1)).any(-1)).nonzero().flatten():
            first = ranks[t].argmax()
            assert (seq[:t] == first).any(-1).sum() == 12  # filled before t
    later = choice.clone()
    later[:, 20:] = torch.randn(3, 20, 8)
    assert torch.equal(top_k_within_capacity(later, 2, 12)[:, :20], tight[:, :20])


def test_group_limits_compose_with_the_balanced_choice():
    """DeepSeek-V3's group-limited routing: with room, every token's experts lie inside its
    best groups (ranked on the balanced scores); where those are full (the tokens all lean
    to the same groups), the capacity still holds, by going outside them."""
    kw = dict(num_groups=4, top_k_groups=2, score_func="sigmoid", route_norm=True)
    tokens = _alike_tokens(low_rank=True)
    roomy = _experts(_router(router_selection="sinkhorn", capacity_factor=8.0, **kw), tokens)
    plain = _router(router_selection="sinkhorn", **kw)
    assert torch.equal(roomy.sort(-1).values, _experts(plain, tokens).sort(-1).values)
    with torch.no_grad():
        logits = plain.gate(tokens)
        offsets = sinkhorn_offsets(logits, SEQS, plain.args.sinkhorn_iters)
        outside = plain._outside_best_groups((logits + offsets).sigmoid())
    assert not outside.gather(-1, roomy).any()
    capped = _experts(_router(router_selection="sinkhorn", capacity_factor=1.25, **kw), tokens)
    assert _spread(capped) <= 1.25


def test_eval_routes_by_plain_top_k_and_training_is_layout_free():
    """Eval (validation, generation, export) is the reference's top-k whatever the training
    choice; in training, each sequence is balanced on its own, so routing the batch at once
    or a sequence at a time (another data-parallel or pipeline layout) chooses alike."""
    tokens = _alike_tokens(low_rank=True)
    router = _router(router_selection="sinkhorn", capacity_factor=1.25)
    together = _experts(router, tokens)
    apart = torch.cat([router(t, None, 1)[1] for t in tokens.view(SEQS, SEQ, DIM)])
    assert torch.equal(together, apart)
    router.eval()
    with torch.no_grad():
        weights, experts, scores = router(tokens, None, SEQS)
    assert torch.equal(experts.sort(-1).values, scores.topk(2, -1).indices.sort(-1).values)


def test_weights_are_the_scores_of_the_chosen_experts_and_train_the_router():
    router = _router(router_selection="sinkhorn", capacity_factor=1.25)
    tokens = _alike_tokens(low_rank=True)
    weights, experts, scores = router(tokens, None, SEQS)
    torch.testing.assert_close(weights, scores.gather(-1, experts))
    (weights * torch.randn_like(weights)).sum().backward()
    grad = router.gate.weight.grad
    assert grad is not None and grad.abs().sum() > 0 and grad.isfinite().all()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(router_selection="sinkhorn", load_balance_coeff=1e-3), "load_balance_coeff = None"),
        (dict(capacity_factor=0.8), "capacity_factor = 0.8 must be 1 or more"),
        (dict(router_selection="greedy"), "router_selection = 'greedy': use topk or sinkhorn"),
    ],
)
def test_inconsistent_balancing_is_refused(kw, message):
    problems = MoEArgs(**{"load_balance_coeff": None, **kw}).problems(DIM)
    assert any(message in p for p in problems), problems


def test_only_training_forwards_count_towards_the_load():
    """The step's load (the metric, the expert bias's update) is training's: a validation
    forward, routed otherwise (uncapped), adds nothing to it."""
    torch.manual_seed(0)
    layer = MoE(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=16, capacity_factor=1.25))
    x = torch.randn(2, 8, DIM)
    with torch.no_grad():
        layer.eval()(x)
        assert layer.tokens_per_expert.sum() == 0
        layer.train()(x)
    assert layer.tokens_per_expert.sum() == 2 * 8 * 2


def test_router_centering_spreads_tokens_that_share_a_direction_from_the_next_step_on():
    """Router centering subtracts the last training step's mean router input: tokens nearly
    parallel to one direction, which plain top-k sends to one pair of experts, spread once a
    step has set the center, in training and eval alike (it is the router's own choice, not
    a training-only one)."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, load_balance_coeff=None)
    layers = {c: MoE(DIM, dataclasses.replace(args, router_centering=c)) for c in (False, True)}
    for layer in layers.values():
        torch.manual_seed(5)  # the same router
        torch.nn.init.normal_(layer.router.gate.weight, std=0.3)
    first, second = _alike_tokens(low_rank=False), _alike_tokens(low_rank=False).flip(0)
    second = second + 0.05 * torch.randn_like(second)  # the next step's tokens, alike too

    def experts(layer, tokens):
        center = layer.router_center if layer.args.router_centering else None
        with torch.no_grad():
            return layer.router(tokens, None, SEQS, center)[1]

    centered = layers[True]
    assert _spread(experts(centered, first)) == 4.0  # the center starts at zero
    with torch.no_grad():  # a step of two microbatches: the center is their mean
        for half in first.view(2, -1, SEQ, DIM):
            centered(half)
    centered.update_expert_bias()
    torch.testing.assert_close(centered.router_center, first.mean(0), rtol=1e-5, atol=1e-6)
    assert centered.router_input_sum.abs().sum() == 0  # counting starts again
    kept = centered.router_center.clone()
    centered.update_expert_bias()  # a step without tokens (none routed here) keeps it
    assert torch.equal(centered.router_center, kept)
    assert _spread(experts(layers[False], second)) == 4.0
    assert _spread(experts(centered, second)) <= 1.5
    trained = experts(centered, second)
    assert torch.equal(experts(centered.eval(), second), trained)  # eval routes alike
    assert "router_center" in centered.state_dict()  # state: a resumed run routes alike
    assert "router_center" not in layers[False].state_dict()  # the references' unchanged
