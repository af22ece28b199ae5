"""Ranger21, every component on, takes the steps one process takes under every layout: FSDP2
(2 and 4 ranks), TP2 (column- and row-wise sharded weights), FSDP2 x TP2, HSDP, DDP, PP2 and
PP2 x FSDP2 (and its compiled step under FSDP2 x TP2); and the same optimizer with statistics
taken on each rank's local shard does not. Muon (Newton-Schulz on whole matrices gathered from
their shards, or dealt out to one owner rank each) does too under FSDP2, TP2, DDP, PP2,
FSDP2 x TP2, HSDP and PP2 x FSDP2, and orthogonalising each rank's shard alone does not.

One spawn per world size (2 and 4 ranks, real gloo groups on CPU, both at once); each rank
runs every case of its size: 5 steps of the tiny transformer on the parity matrix's batch
(`parity_worker`), against the 1-process run.
"""

from __future__ import annotations

import pytest
from parity_worker import Case, reference, start_cases

STEPS = 5
R = dict(optimizer="ranger21", steps=STEPS)
CASES_2 = [
    Case("ranger21_fsdp2", 2, **R),
    Case("ranger21_tp2", 2, tp=2, **R),
    Case("ranger21_ddp2", 2, dp_shard=1, dp_replicate=2, **R),
    Case("ranger21_pp2", 2, pp=2, **R),
]
NAIVE = Case("ranger21_tp2_local_shard_statistics", 2, tp=2, extra={"naive": True}, **R)
M = dict(optimizer="muon", steps=STEPS)
MO = dict(optimizer="muon_owner", steps=STEPS)
CASES_2 += [
    Case("muon_fsdp2", 2, **M),
    Case("muon_tp2", 2, tp=2, **M),
    Case("muon_pp2", 2, pp=2, **M),
    Case("muon_owner_fsdp2", 2, **MO),
    Case("muon_owner_tp2", 2, tp=2, **MO),
]
MUON_NAIVE = Case("muon_fsdp2_local_shard_orthogonalised", 2, extra={"naive": True}, **M)
CASES_4 = [
    Case("ranger21_fsdp4", 4, **R),
    Case("ranger21_fsdp2_x_tp2", 4, tp=2, **R),
    Case("ranger21_hsdp_2x2", 4, dp_replicate=2, dp_shard=2, **R),
    Case("ranger21_pp2_x_fsdp2", 4, pp=2, **R),
    Case("ranger21_madgrad_fsdp2_x_tp2", 4, tp=2, optimizer="ranger21_madgrad", steps=STEPS),
    Case("ranger21_compiled_fsdp2_x_tp2", 4, tp=2, optimizer="ranger21_compiled", steps=STEPS),
    Case("muon_fsdp2_x_tp2", 4, tp=2, **M),
    Case("muon_owner_hsdp_2x2", 4, dp_replicate=2, dp_shard=2, **MO),
    Case("muon_pp2_x_fsdp2", 4, pp=2, **MO),
]
REFERENCE = {"muon_owner": "muon"}  # one process: the same steps
# Where each Muon layout orthogonalises its matrices: whole where they are (pipeline stages
# without FSDP), gathered, or by owner ranks (FSDP x TP splits a matrix over two mesh
# dimensions, which `owner` leaves to `gather`).
MUON_PATHS = {
    "muon_fsdp2": {"gather"},
    "muon_tp2": {"gather"},
    "muon_pp2": {"local"},
    "muon_owner_fsdp2": {"owner"},
    "muon_owner_tp2": {"owner"},
    "muon_fsdp2_x_tp2": {"gather"},
    "muon_owner_hsdp_2x2": {"owner"},
    "muon_pp2_x_fsdp2": {"owner"},
}


@pytest.fixture(scope="module")
def refs() -> dict:
    names = ("ranger21", "ranger21_madgrad", "ranger21_compiled", "muon")
    return {name: reference("tiny", name, STEPS) for name in names}


@pytest.fixture(scope="module")
def launched() -> dict:
    return {2: start_cases(2, [*CASES_2, NAIVE, MUON_NAIVE]), 4: start_cases(4, CASES_4)}


@pytest.fixture(scope="module")
def results(launched) -> dict:
    out = {}
    for world in (2, 4):
        got = launched[world].results()
        got.pop("_startup_seconds")
        out.update(got)
    return out


def relative_error(got: dict, ref: dict) -> float:
    """The size of the difference of the whole model's weights, relative to their size."""
    diff = sum((got[k] - v).pow(2).sum() for k, v in ref.items()).sqrt()
    return float(diff / sum(v.pow(2).sum() for v in ref.values()).sqrt())


@pytest.mark.parametrize("case", CASES_2 + CASES_4, ids=lambda c: c.name)
def test_layout_takes_the_one_process_steps(case: Case, results: dict, refs: dict):
    got, ref = results[case.name], refs[REFERENCE.get(case.optimizer, case.optimizer)]
    assert "error" not in got, got.get("error")
    assert sorted(got["params"]) == sorted(ref["params"])
    err = relative_error(got["params"], ref["params"])
    print(f"{case.name}: parameters after {STEPS} steps, relative error {err:.2e}")
    # Only the order of fp32 sums differs (sharded matmuls, reduce-scatter, the statistics'
    # all-reduces). Measured: at most ~1e-7 for Ranger21 (the softplus denominator keeps Adam
    # from amplifying the noise of near-zero gradients), ~2e-7 for Muon (Newton-Schulz in
    # fp32 on the same whole matrices on every layout).
    assert err <= 1e-5, err
    for step in range(STEPS):
        assert abs(got["losses"][step] - ref["losses"][step]) <= 1e-5 * abs(ref["losses"][step])
    if case.optimizer.startswith("muon"):
        # 7 matrices per block x 2 blocks (one block per pipeline stage), each step.
        paths = got["muon_paths"]
        assert sum(paths.values()) == STEPS * 14 // (case.pp if case.pp > 1 else 1), paths
        expected = MUON_PATHS[case.name]
        assert {k for k, v in paths.items() if v} == expected, (paths, expected)


def test_statistics_of_the_local_shard_only_give_other_steps(results: dict, refs: dict):
    """Row-wise TP weights (wo, w2: Shard(1)) split every row over the two ranks: per-row
    norms and means of a half row are not those of the row."""
    got = results[NAIVE.name]
    assert "error" not in got, got.get("error")
    err = relative_error(got["params"], refs["ranger21"]["params"])
    print(f"local-shard statistics under TP2: relative error {err:.2e}")
    # Ten times the exact layouts' tolerance (their measured error is ~1e-8).
    assert err > 1e-4, err
    ref = refs["ranger21"]["params"]
    rowwise = max(
        float((got["params"][k] - ref[k]).norm() / ref[k].norm())
        for k in ref
        if k.endswith(("wo.weight", "w2.weight"))
    )
    assert rowwise > 1e-4, rowwise


def test_muon_orthogonalising_each_shard_alone_gives_other_steps(results: dict, refs: dict):
    """Under FSDP2 each rank holds half the rows of every matrix: Newton-Schulz on half a
    matrix is not half of Newton-Schulz on the matrix."""
    got = results[MUON_NAIVE.name]
    assert "error" not in got, got.get("error")
    ref = refs["muon"]["params"]
    err = relative_error(got["params"], ref)
    print(f"Muon on local shards under FSDP2: relative error {err:.2e}")
    assert err > 1e-3, err  # a hundred times the exact layouts' tolerance
    hidden = max(
        float((got["params"][k] - ref[k]).norm() / ref[k].norm()) for k in ref if ".wq." in k
    )
    assert hidden > 1e-3, hidden
