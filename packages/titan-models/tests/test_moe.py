"""The mixture-of-experts layer against plain references, in float32 on CPU: the grouped-matmul
experts against the per-expert loop (forward and gradients), routing against a brute-force
reading of its definition, the layer against a dense computation over all experts, and both
load-balancing schemes doing what they are for."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from titan_models.moe import MoE, MoEArgs

DIM = 32


def _moe(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    args = MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": 48, **kw})
    layer = MoE(DIM, args)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.3 if "gate" in name else 0.1)
    return layer


def _dense_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the router's weight where chosen, 0 elsewhere."""
    tokens = x.reshape(-1, DIM)
    bias = layer.expert_bias if layer.args.load_balance_coeff is not None else None
    weights, experts, _ = layer.router(tokens, bias)
    gate = torch.zeros(tokens.shape[0], layer.args.num_experts).scatter_(-1, experts, weights)
    e = layer.experts
    out = torch.zeros_like(tokens)
    for i in range(layer.args.num_experts):
        y = (F.silu(tokens @ e.w1[i]) * (tokens @ e.w3[i])) @ e.w2[i]
        out = out + gate[:, i : i + 1] * y
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(tokens)
    return out.view_as(x)


@pytest.mark.parametrize("shared", [0, 1])
def test_layer_equals_the_dense_computation_over_all_experts(shared):
    layer = _moe(num_shared_experts=shared)
    x = torch.randn(3, 5, DIM)
    torch.testing.assert_close(layer(x), _dense_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_grouped_matmul_matches_the_loop_in_values_and_gradients():
    grouped, loop = _moe(use_grouped_mm=True), _moe(use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(4, 7, DIM)
    target = torch.randn(4, 7, DIM)
    outs = []
    for layer in (grouped, loop):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        ((y - target) ** 2).mean().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y1, gx1, g1), (y2, gx2, g2) = outs
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx2, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_expert_without_tokens_is_fine():
    layer = _moe(num_experts=8, top_k=1)
    with torch.no_grad():
        layer.expert_bias[3] = -100.0  # never chosen
    x = torch.randn(2, 6, DIM)
    y = layer(x)
    assert layer.tokens_per_expert[3] == 0
    torch.testing.assert_close(y, _dense_reference(layer, x), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert torch.count_nonzero(layer.experts.w1.grad[3]) == 0


def _brute_force_choice(scores, bias, args: MoEArgs):
    """The top-k experts by (score + bias) among the experts of the best groups, each group
    ranked by the sum of its two best (score + bias): by enumeration."""
    per_group = args.num_experts // args.num_groups
    choice = scores + bias
    picks = []
    for row in choice:
        groups = [row[g * per_group : (g + 1) * per_group] for g in range(args.num_groups)]
        rank = [sorted(g.tolist(), reverse=True)[: min(2, per_group)] for g in groups]
        best_groups = sorted(range(args.num_groups), key=lambda g: -sum(rank[g]))[
            : args.top_k_groups
        ]
        allowed = [e for g in best_groups for e in range(g * per_group, (g + 1) * per_group)]
        picks.append(set(sorted(allowed, key=lambda e: -row[e].item())[: args.top_k]))
    return picks


@pytest.mark.parametrize(
    "score_func,groups,top_groups,norm", [("softmax", 1, 1, False), ("sigmoid", 4, 2, True)]
)
def test_routing_chooses_by_score_plus_bias_and_weighs_by_score(
    score_func, groups, top_groups, norm
):
    args = dict(score_func=score_func, num_groups=groups, top_k_groups=top_groups,
                route_norm=norm, route_scale=2.5, top_k=3)  # fmt: skip
    layer = _moe(**args)
    with torch.no_grad():
        layer.expert_bias.copy_(torch.randn(8) * 0.2)
    tokens = torch.randn(40, DIM)
    weights, experts, scores = layer.router(tokens, layer.expert_bias)
    expected_scores = layer.router.gate(tokens).float()
    expected_scores = (
        expected_scores.softmax(-1) if score_func == "softmax" else expected_scores.sigmoid()
    )
    torch.testing.assert_close(scores, expected_scores)
    picks = _brute_force_choice(scores, layer.expert_bias, layer.args)
    assert [set(row.tolist()) for row in experts] == picks
    chosen = scores.gather(-1, experts)  # the weights come from the scores, not the bias
    if norm:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, chosen * 2.5)


def test_expert_bias_update_evens_out_the_load():
    """Tokens drawn so that a few experts are favoured: with the bias updated after every step
    the spread of the load (max / mean) falls (from about 3.9 to about 1.6 here); without it,
    it stays. Sigmoid scores, as in DeepSeek-V3."""

    def spread_after(coeff, steps=60):
        layer = _moe(seed=1, load_balance_coeff=coeff, top_k=2, score_func="sigmoid")
        torch.manual_seed(2)
        skew = torch.randn(DIM) * 2  # every token leans the same way
        spreads = []
        for _ in range(steps):
            with torch.no_grad():
                layer(torch.randn(4, 16, DIM) + skew)
            counts = layer.update_expert_bias()
            spreads.append((counts.max() / counts.mean()).item())
        return sum(spreads[:5]) / 5, sum(spreads[-5:]) / 5

    start, end = spread_after(0.02)
    assert end < 0.6 * start, (start, end)
    start_off, end_off = spread_after(None)
    assert end_off > 0.9 * start_off, (start_off, end_off)


@pytest.mark.parametrize("kind", ["sequence", "batch"])
def test_aux_loss_gradient_is_added_in_backward(kind):
    """With aux_loss_alpha the parameters' gradients are those of (task loss + alpha * the
    balance loss), computed here from the definition, per sequence (DeepSeek-V3) or over every
    token of the batch (Qwen3-MoE); the output is unchanged."""
    alpha = 0.5
    with_aux = _moe(aux_loss_alpha=alpha, aux_loss_type=kind)
    without = _moe(aux_loss_alpha=0.0)
    x, target = torch.randn(2, 9, DIM), torch.randn(2, 9, DIM)
    y = with_aux(x)
    torch.testing.assert_close(y, without(x))
    ((y - target) ** 2).mean().backward()

    ref = _moe(aux_loss_alpha=0.0)
    tokens = x.reshape(-1, DIM)
    _, experts, scores = ref.router(tokens, ref.expert_bias)
    rows, seq = (2, 9) if kind == "sequence" else (1, 18)
    scores, experts = scores.view(rows, seq, -1), experts.view(rows, seq, -1)
    chosen = torch.zeros_like(scores).scatter_(-1, experts, 1.0)
    f = chosen.sum(1) * (8 / (2 * seq))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    aux = alpha * (f * p).sum(-1).mean()
    (((ref(x) - target) ** 2).mean() + aux).backward()
    torch.testing.assert_close(with_aux.aux_loss, aux.detach())
    for (name, p1), p2 in zip(with_aux.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert with_aux.router.gate.weight.grad is not None


def test_inconsistent_arguments_are_named():
    with pytest.raises(ValueError, match="top_k = 9 must be 1 .. num_experts"):
        MoE(DIM, MoEArgs(num_experts=8, top_k=9))
    with pytest.raises(ValueError, match="not divisible by num_groups"):
        MoE(DIM, MoEArgs(num_experts=8, num_groups=3))
    for k, g in itertools.product([5], [1]):
        with pytest.raises(ValueError, match="more than the experts"):
            MoE(DIM, MoEArgs(num_experts=8, top_k=k, num_groups=4, top_k_groups=g))


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_plan_names_what_expert_and_tensor_parallel_split(shared):
    # titan-parallel reads this plan (it cannot import this package): the names must resolve,
    # the expert weights stack the experts along dim 0, and the experts are called as
    # experts(x, counts) with x sorted by expert.
    layer = _moe(num_shared_experts=shared)
    plan = layer.moe_plan()
    assert plan.num_experts == 8 and layer.get_submodule(plan.experts) is layer.experts
    assert layer.get_submodule(plan.router) is layer.router and plan.weights_scale_outputs
    for name, split in plan.expert_weights.items():
        weight = getattr(layer.experts, name)
        assert weight.shape[0] == 8 and split in ("colwise", "rowwise")
    assert dict(plan.expert_weights) == {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}
    shared_linears = {n for n, m in layer.named_modules() if n.startswith("shared_experts.")}
    assert set(plan.shared_experts) == shared_linears
