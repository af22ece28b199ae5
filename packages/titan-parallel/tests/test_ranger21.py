"""Ranger21 and titan-parallel's AdamW on one process: each component does what its paper
says, each switch turns it off, and the bfloat16 states save memory and keep the loss close."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from parallel_testmodel import TinyArgs, TinyTransformer, cross_entropy

from titan_parallel import AdamW, Ranger21, stochastic_round_to_bf16
from titan_parallel.ranger21 import COMPONENTS

OFF = dict.fromkeys(COMPONENTS, False)


def _model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer()
    model.init_weights()
    return model


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TinyArgs().vocab, (4, 17), generator=g) for _ in range(n)]


def _train(model, opt, batches) -> list[float]:
    losses = []
    for x in batches:
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_adamw_takes_exactly_torchs_steps() -> None:
    ours, theirs = _model(), _model()
    batches = _batches(4)
    _train(ours, AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1), batches)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1), batches)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        # Same operations in the same order as torch's foreach AdamW: bitwise equal.
        assert torch.equal(a, b)


def test_ranger21_with_every_component_off_is_adamw() -> None:
    ours, theirs = _model(), _model()
    batches = _batches(3)
    _train(ours, Ranger21(ours.parameters(), lr=1e-2, weight_decay=0.1, **OFF), batches)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1), batches)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("component", [k for k in OFF if k not in ("warmup", "warmdown")])
def test_each_component_changes_the_step_and_its_switch_turns_it_off(component: str) -> None:
    """Every component on vs the same with one off: different weights after 5 steps (the
    Lookahead merge happens at step 5)."""
    on, off = _model(), _model()
    batches = _batches(5)
    kwargs = dict(lr=1e-2, total_steps=100, warmup=False, warmdown=False)
    _train(on, Ranger21(on.parameters(), **kwargs), batches)
    _train(off, Ranger21(off.parameters(), **(kwargs | {component: False})), batches)
    diff = max((a - b).abs().max().item() for a, b in zip(on.parameters(), off.parameters()))
    assert diff > 1e-7, component


def _one_step_grads(opt_kwargs: dict):
    model = _model()
    x = _batches(1)[0]
    cross_entropy(model(x[:, :-1]), x[:, 1:]).backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    opt = Ranger21(model.parameters(), lr=0.0, **(OFF | opt_kwargs))
    opt.step()
    return model, before


def test_agc_caps_each_units_gradient_norm_at_clip_times_its_weight_norm() -> None:
    model, before = _one_step_grads(dict(agc=True, agc_clip=1e-3, agc_eps=1e-3))
    clipped_any = False
    for name, p in model.named_parameters():
        w, g0 = before[name]
        dims = tuple(range(1, w.ndim)) or None
        w_norm = torch.linalg.vector_norm(w, dim=dims).clamp(min=1e-3)
        g_norm = torch.linalg.vector_norm(p.grad, dim=dims)
        g0_norm = torch.linalg.vector_norm(g0, dim=dims)
        limit = 1e-3 * w_norm
        # fp32 rounding of the scaled gradient: well under 1e-5 relative.
        assert torch.all(g_norm <= limit * (1 + 1e-5)), name
        kept = g0_norm <= limit  # units under the limit keep their gradient as it was
        if w.ndim > 1:
            assert torch.equal(p.grad[kept], g0[kept]), name
        elif bool(kept):
            assert torch.equal(p.grad, g0), name
        clipped_any |= bool((~kept).any())
    assert clipped_any


def test_gradient_centralization_leaves_every_row_with_zero_mean() -> None:
    model, before = _one_step_grads(dict(gradient_centralization=True))
    for name, p in model.named_parameters():
        g0 = before[name][1]
        if p.ndim > 1:
            assert p.grad.mean(dim=1).abs().max() < 1e-8, name
            assert torch.allclose(p.grad, g0 - g0.mean(dim=1, keepdim=True), atol=1e-8)
        else:  # vectors are left alone
            assert torch.equal(p.grad, g0), name


def test_norm_loss_and_stable_decay_follow_their_formulas() -> None:
    """One step with stable weight decay and norm loss on, against the closed form: both
    multiplicative factors, then Adam's first step."""
    lr, wd, factor = 1e-2, 1e-2, 1e-1
    model = _model()
    ref = copy.deepcopy(model)
    x = _batches(1)[0]
    for m in (model, ref):
        cross_entropy(m(x[:, :-1]), x[:, 1:]).backward()
    opt = Ranger21(
        model.parameters(),
        lr=lr,
        weight_decay=wd,
        **(OFF | dict(norm_loss=True, norm_loss_factor=factor, stable_weight_decay=True)),
    )
    opt.step()
    # By hand: v = (1 - b2) g^2, bias-corrected v_hat = g^2; v_bar = sqrt(mean g^2) over all.
    grads = [p.grad for p in ref.parameters()]
    v_bar = torch.cat([g.flatten() ** 2 for g in grads]).mean().sqrt()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        w = r.detach() * (1 - lr * wd / v_bar)
        dims = tuple(range(1, w.ndim)) or None
        norm = torch.linalg.vector_norm(w, dim=dims, keepdim=w.ndim > 1)
        w = w * (1 - lr * 2 * factor * (1 - 1 / (norm + 1e-8)))
        g = r.grad
        w = w - lr * g / (g.abs() + 1e-8)  # Adam's first step: m_hat / sqrt(v_hat) = sign(g)
        # Same formula in another order of fp32 operations: a few ulps.
        assert torch.allclose(p, w, rtol=1e-5, atol=1e-7), name


def test_lookahead_merges_towards_the_slow_weights_every_k_steps() -> None:
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = Ranger21(model.parameters(), lr=1e-2, **(OFF | dict(lookahead=True, lookahead_steps=3)))
    batches = _batches(3)
    _train(model, opt, batches[:2])
    fast = copy.deepcopy(model)
    fast_opt = Ranger21(fast.parameters(), lr=1e-2, **OFF)
    saved = copy.deepcopy(opt.state_dict())  # the same moments, without the slow weights
    for state in saved["state"].values():
        del state["slow"]
    fast_opt.load_state_dict(saved)
    _train(model, opt, batches[2:])
    _train(fast, fast_opt, batches[2:])
    for p, f, s0 in zip(model.parameters(), fast.parameters(), start):
        # At step 3: p = 0.5 fast + 0.5 slow (the initial weights), and slow = p.
        assert torch.allclose(p, 0.5 * f + 0.5 * s0, atol=1e-7)
        assert torch.equal(opt.state[p]["slow"], p)


def test_schedule_warms_up_linearly_then_warms_down_to_the_floor() -> None:
    opt = Ranger21(
        [torch.zeros(1, requires_grad=True)],
        lr=1e-2,
        betas=(0.9, 0.99),
        total_steps=1000,
        warmdown_min_lr=1e-4,
    )
    assert opt.warmup_steps == 200  # Ma & Yarats: 2 / (1 - b2)
    assert opt.lr_at(1e-2, 1) == pytest.approx(1e-2 / 200)
    assert opt.lr_at(1e-2, 100) == pytest.approx(0.5e-2)
    assert opt.lr_at(1e-2, 200) == pytest.approx(1e-2)
    assert opt.lr_at(1e-2, 720) == pytest.approx(1e-2)  # flat until 72% of the run
    assert opt.lr_at(1e-2, 860) == pytest.approx((1e-2 + 1e-4) / 2)
    assert opt.lr_at(1e-2, 1000) == pytest.approx(1e-4)
    short = Ranger21([torch.zeros(1, requires_grad=True)], lr=1e-2, total_steps=100)
    assert short.warmup_steps == 22  # 2 / (1 - 0.999) = 2000 is most of the run: 22%
    assert opt.owns_lr_schedule and not AdamW([torch.zeros(1)]).owns_lr_schedule


def test_softplus_raises_small_denominators() -> None:
    # A parameter whose gradient is small: Adam's first step is lr (m_hat / sqrt(v_hat) = 1);
    # the softplus denominator (at least log(2)/50 ~ 0.014) makes it ~ lr g / 0.014.
    g = 1e-4
    soft = math.log1p(math.exp(50 * (g + 1e-8))) / 50
    for softplus, expected in ((False, 1e-2 * g / (g + 1e-8)), (True, 1e-2 * g / soft)):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = Ranger21([p], lr=1e-2, **(OFF | dict(softplus=softplus)))
        p.grad = torch.full((4,), g)
        opt.step()
        assert -p.mean().item() == pytest.approx(expected, rel=1e-3), softplus


def test_madgrad_core_trains() -> None:
    model = _model()
    opt = Ranger21(model.parameters(), lr=1e-2, core="madgrad", total_steps=30)
    losses = _train(model, opt, _batches(1) * 30)
    assert set(opt.state[next(model.parameters())]) == {
        "step",
        "grad_sum",
        "grad_sum_sq",
        "x0",
        "slow",
    }
    assert losses[-1] < 0.9 * losses[0], losses


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="total_steps is not set"):
        Ranger21([torch.zeros(1)], lr=1e-3)
    with pytest.raises(ValueError, match="core = 'sgd'"):
        Ranger21([torch.zeros(1)], core="sgd", total_steps=10)


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 1.0 + 2**-10)  # between two bfloat16 values (1 and 1 + 2^-7)
    rounded = stochastic_round_to_bf16(x).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    # The mean of 2e5 draws of a two-point variable: standard error 2^-7 * 0.33 / 447 ~ 6e-6.
    assert abs(rounded.mean().item() - x[0].item()) < 5e-5


@pytest.mark.parametrize("name", ["AdamW", "Ranger21"])
def test_bf16_states_halve_the_state_memory_and_keep_the_loss_close(name: str) -> None:
    """50 steps on the tiny model with float32 and with bfloat16 moments."""
    batches = _batches(10) * 5
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model()
        if name == "AdamW":
            opt = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), state_dtype=dtype)
        else:
            # Ranger21's softplus denominator and AGC take smaller steps: a larger lr.
            opt = Ranger21(model.parameters(), lr=3e-2, total_steps=50, state_dtype=dtype)
        losses = _train(model, opt, batches)
        moments = sum(
            v.numel() * v.element_size()
            for s in opt.state.values()
            for k, v in s.items()
            if k not in ("step", "slow", "x0")
        )
        results[dtype] = (losses, moments)
    (l32, m32), (l16, m16) = results[torch.float32], results[torch.bfloat16]
    assert m16 * 2 == m32
    assert sum(l32[-10:]) < 0.95 * sum(l32[:10])  # it trains (the 5th pass over 10 batches)
    # bf16 keeps 8 mantissa bits; stochastic rounding keeps the averages unbiased. Measured
    # mean |loss difference| over the last 10 steps: ~1e-3 relative. Bound: 2%.
    diff = sum(abs(a - b) / a for a, b in zip(l32[-10:], l16[-10:])) / 10
    assert diff < 0.02, (diff, l32[-10:], l16[-10:])


# Inductor vectorises and fuses (another rounding of the same formulas): ~3e-7 relative after
# one step, ~1e-5 after 6 (measured). Without the softplus denominator, Adam's g / (|g| + eps)
# turns rounding-level differences of gradients near eps into lr-sized steps for those
# elements: measured 7e-5 on the embedding. bf16 states round the same values, except where
# that noise flips a rounding.
COMPILED_CASES = {
    "every_component": (dict(), 3e-5),
    "madgrad": (dict(core="madgrad"), 3e-5),
    "adam_momentum_plain_decay": (
        dict(pnm=False, softplus=False, norm_loss=False, stable_weight_decay=False),
        3e-4,
    ),
    "bf16_states": (dict(state_dtype=torch.bfloat16), 1e-2),
}


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_step_takes_the_eager_steps(case: str) -> None:
    """The fused, compiled kernels (`compiled=True`) compute the eager step's formulas: 6 steps
    (a Lookahead merge at 5, both momentum buffers in turn) agree to fp32 rounding."""
    options, tol = COMPILED_CASES[case]
    kw = dict(lr=1e-2, total_steps=6, warmup_steps=2, weight_decay=0.1, **options)
    eager, fused = _model(), _model()
    losses = {}
    for name, model, compiled in (("eager", eager, False), ("fused", fused, True)):
        torch.manual_seed(123)  # the same stochastic rounding draws (bf16 states)
        opt = Ranger21(model.parameters(), compiled=compiled, **kw)
        losses[name] = _train(model, opt, _batches(6))
    assert losses["fused"] == pytest.approx(losses["eager"], rel=tol)
    with torch.no_grad():
        for (name, a), b in zip(eager.named_parameters(), fused.parameters()):
            err = float((a - b).norm() / a.norm())
            assert err <= tol, (name, err)
