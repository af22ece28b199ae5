"""Expert parallel trains like one process: a user's mixture-of-experts transformer
(moe_testmodel: top-k router with a load-balancing bias, 8 stacked experts, a shared expert)
under EP alone, EP with FSDP, HSDP, TP, PP and CP, with activation checkpointing and compile,
and MoE layers under plain TP; on real gloo groups of 2 and 4 ranks, fp32, 5 AdamW steps on
the global batch one process takes, the biases rebalanced after each step from the counts of
every rank. Muon (each expert's matrix orthogonalised alone, the router by AdamW) under EP,
EP x TP (expert matrices split by TP, gathered) and EP x FSDP splitting expert rows (owner
ranks) does too.

What is compared, and why each: initial weights (bitwise: exact initialisation of expert
shards), the first step's gradients (a missing or doubled reduction of expert gradients shows
there, while Adam's steps are nearly blind to a factor of 2), losses and gradient norms at
every step, the expert biases (the routing and the counts summed over the right ranks) and
the final weights.
"""

from __future__ import annotations

import pytest
import torch
from ep_worker import STEPS, EPCase, reference, run_ep_case
from moe_testmodel import MoEArgs, TinyMoE
from parity_worker import start_cases

CASES_2 = [
    EPCase("ep2", 2, ep=2),
    EPCase("moe_under_tp2_sp", 2, tp=2),
    EPCase("moe_under_tp2_no_sp", 2, tp=2, sp=False),
    EPCase("ep2_ac_op", 2, ep=2, ac="selective"),
    EPCase("ep2_ac_full_compile", 2, ep=2, ac="full", compile=True),
    EPCase("ep2_borrowed_from_cp2", 2, cp=2, ep=2),
]
CASES_4 = [
    EPCase("ep2_fsdp2", 4, ep=2),
    EPCase("ep4", 4, ep=4),
    EPCase("ep2_tp2", 4, ep=2, tp=2),
    EPCase("pp2_ep2", 4, pp=2, ep=2),
    EPCase("hsdp2_ep2", 4, dp_replicate=2, ep=2),
    # One expert per EP rank, split by FSDP over 2 ranks along its rows (dim 1), not dim 0.
    EPCase("ep2_fsdp2_expert_rows_split", 4, ep=2, experts=2),
]
MUON = {"optimizer": "muon"}
CASES_2 += [EPCase("muon_ep2", 2, ep=2, extra=MUON)]
CASES_4 += [
    EPCase("muon_ep2_tp2", 4, ep=2, tp=2, extra=MUON),
    EPCase(
        "muon_owner_ep2_fsdp2_expert_rows_split",
        4,
        ep=2,
        experts=2,
        extra={"optimizer": "muon_owner"},
    ),
]
# Where Muon orthogonalised the matrices (see test_ranger21_parity.MUON_PATHS): experts split
# by EP only are whole on their rank; TP splits them (gathered); FSDP over expert rows too (an
# owner rank each).
MUON_PATHS = {
    "muon_ep2": {"local", "gather"},  # attention and shared-expert matrices under FSDP: gather
    "muon_ep2_tp2": {"gather"},
    "muon_owner_ep2_fsdp2_expert_rows_split": {"owner"},
}
LAYOUT = {  # where w1 of the first MoE layer lives (mesh dimensions, placements)
    "ep2": "('ep_shard', 'ep') (_StridedShard(dim=0, sf=2), Shard(dim=0))",
    "moe_under_tp2_sp": "('tp',) (Shard(dim=2),)",
    "ep2_tp2": "('ep_shard', 'ep', 'tp') (_StridedShard(dim=0, sf=2), Shard(dim=0), Shard(dim=2))",
    "hsdp2_ep2": "('dp_replicate', 'ep_shard', 'ep') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))",
    "ep2_fsdp2_expert_rows_split": "('ep_shard', 'ep') (Shard(dim=1), Shard(dim=0))",
}


@pytest.fixture(scope="module")
def launched() -> dict:
    # Both worlds at once: their ranks spend much of their time importing torch and waiting
    # on each other, which the other world's ranks fill.
    return {
        2: start_cases(2, CASES_2, runner=run_ep_case),
        4: start_cases(4, CASES_4, runner=run_ep_case),
    }


@pytest.fixture(scope="module")
def refs() -> dict:
    keys = {(c.experts, c.extra.get("optimizer", "adamw")) for c in CASES_2 + CASES_4}
    return {key: reference(*key) for key in keys}


@pytest.fixture(scope="module")
def results(launched) -> dict:
    out = {}
    for world, run in launched.items():
        got = run.results()
        timings = ", ".join(f"{k} {v.get('total_seconds', 0):.1f}s" for k, v in got.items() if isinstance(v, dict))  # fmt: skip
        print(f"\n{world} ranks: start-up {got.pop('_startup_seconds'):.1f}s; {timings}")
        out.update(got)
    return out


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("case", CASES_2 + CASES_4, ids=lambda c: c.name)
def test_layout_trains_like_one_process(case: EPCase, results: dict, refs: dict) -> None:
    got, ref = results[case.name], refs[(case.experts, case.extra.get("optimizer", "adamw"))]
    assert "error" not in got, got.get("error")
    if case.name in MUON_PATHS:
        paths = got["muon_paths"]
        assert {k for k, v in paths.items() if v} == MUON_PATHS[case.name], paths
    if case.name in LAYOUT:
        assert got["layout"] == LAYOUT[case.name]
    # Exact initialisation: each shard is cut from the weights one process draws.
    for name, value in ref["initial"].items():
        assert torch.equal(got["initial"][name], value), name
    # Same weights, same tokens: only the order of fp32 sums differs (sharded matmuls,
    # all-to-all then sums in another order). Measured: below 1e-6 for every tensor; a
    # wrongly scaled expert gradient (summed over EP ranks and not divided) is off by 1.
    for name, grad in ref["grads"].items():
        assert _rel(got["grads"][name], grad) < 1e-5, (name, _rel(got["grads"][name], grad))
    for step in range(STEPS):
        # After AdamW steps, parameters whose gradient is ~0 move by up to lr in a direction
        # set by fp32 noise (Adam divides by sqrt(v)); that reaches the loss and the norm at
        # ~1e-5. Measured: at most 3e-6 (loss) and 2e-5 (norm).
        tol = 1e-5 if step == 0 else 1e-4
        assert _rel(got["losses"][step], ref["losses"][step]) < tol, (step, got["losses"], ref["losses"])  # fmt: skip
        assert _rel(got["norms"][step], ref["norms"][step]) < 2 * tol, (step, got["norms"], ref["norms"])  # fmt: skip
    # The biases move by +-0.05 per step from integer counts: any routing or counting
    # difference shows as a whole step of 0.05.
    biases = [k for k in ref["final"] if k.endswith("feed_forward.bias")]
    assert biases and all(torch.equal(got["final"][k], ref["final"][k]) for k in biases)
    # Final weights: the relative size of the difference over the whole model (see above;
    # measured below 1e-5).
    diff = sum((got["final"][k] - v).pow(2).sum() for k, v in ref["final"].items()).sqrt()
    size = sum(v.pow(2).sum() for v in ref["final"].values()).sqrt()
    assert diff / size < 1e-4, float(diff / size)
    worst = {  # the measured differences, for the log (pytest -s)
        "loss": max(_rel(a, b) for a, b in zip(got["losses"], ref["losses"])),
        "norm": max(_rel(a, b) for a, b in zip(got["norms"], ref["norms"])),
        "grad": max(_rel(got["grads"][k], g) for k, g in ref["grads"].items()),
        "weights": float(diff / size),
    }
    print(f"\n{case.name}: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))


def test_impossible_expert_layouts_are_refused_with_the_fix() -> None:
    from titan_parallel import expert_parallel_problems

    with torch.device("meta"):
        model = TinyMoE(MoEArgs(num_experts=6, expert_hidden=12))
    assert expert_parallel_problems(model, ep=3, tp=2) == []
    (problem,) = expert_parallel_problems(model, ep=4, tp=1)
    assert (
        "expert_parallel_degree = 4 does not divide the 6 experts of layers.0.feed_forward"
        in problem
    )
    assert "choose a degree that divides 6" in problem
    problems = expert_parallel_problems(model, ep=1, tp=8)
    assert any("tensor_parallel_degree = 8 does not divide the 12 hidden features of layers.0.feed_forward.experts.w1" in p for p in problems), problems  # fmt: skip
    assert any("of layers.0.feed_forward.shared.w2" in p for p in problems), problems
    from parallel_testmodel import TinyTransformer

    with torch.device("meta"):
        dense = TinyTransformer()
    (problem,) = expert_parallel_problems(dense, ep=2, tp=1)
    assert (
        "TinyTransformer has no MoE layer" in problem
        and "set expert_parallel_degree = 1" in problem
    )


def test_a_tp_plan_that_also_splits_a_moe_layer_is_refused():
    from titan_core.protocols import TPPlan
    from titan_parallel.expert_parallel import tp_plan_overlaps

    with torch.device("meta"):
        model = TinyMoE()
    assert tp_plan_overlaps(model, model.tp_plan()) == []
    plan = model.tp_plan()
    twice = TPPlan(plan.root, {**plan.block, "feed_forward": "block_input", "feed_forward.shared.w1": "colwise"})  # fmt: skip
    (problem,) = tp_plan_overlaps(model, twice)
    assert (
        "names feed_forward, feed_forward.shared.w1, inside a mixture-of-experts layer" in problem
    )
