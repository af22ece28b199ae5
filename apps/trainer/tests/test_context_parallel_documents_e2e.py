"""Packed documents under context parallel, the way a user runs it: `titan-train` with
`attn_mask_type = "block_causal"` and `context_parallel_degree = 2` on two processes trains
step by step like one process, in fp32, in both styles: "auto" takes all-to-all (each rank
attends over the whole sequence with half the heads, under the mask of the whole sequence),
"ring" deals the sequence's chunks by the documents' work and runs each pair of chunks under
its own document mask. A ring run resumes exactly from its checkpoint, and its checkpoint
resumed on one process (context parallel off) continues on the same data with the same losses.

The documents are 1 to 60 bytes long, so every 128-token window packs several and many cross
the border between the two ranks' halves of the sequence; plain causal attention on the same
data trains to other losses, by far more than the tolerance.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import fp32_args, parse_losses, start_cli

# fp32, the same numbers in another order (all-to-all moves them; FSDP is off): the metric
# line prints 4 decimals.
TOLERANCE = 2e-4
STEPS = 6


@pytest.fixture(scope="module")
def packed_dataset(tmp_path_factory) -> str:
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    lines = []
    for i in range(400):
        length = 1 + (i * 37) % 60  # 1 .. 60 bytes, in a fixed order
        text = " ".join(words[(i + j) % len(words)] for j in range(12))[:length]
        lines.append(json.dumps({"text": text}))
    path = tmp_path_factory.mktemp("packed") / "packed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_block_causal_attention_under_context_parallel_trains_like_one_process(
    tmp_path, debug_args, packed_dataset
):
    base = [*fp32_args(debug_args, packed_dataset), "--training.steps", str(STEPS)]

    def run(name: str, *extra: str, nproc: int = 1):
        return start_cli([*base, *extra, "--job.dump_folder", str(tmp_path / name)], nproc=nproc)

    block = ["--model.attn_mask_type", "block_causal"]
    started = {
        "one": run("one", *block),
        "cp2": run("cp2", *block, "--parallelism.context_parallel_degree", "2", nproc=2),
        "cp2_ring": run("cp2_ring", *block, *RING, nproc=2),
        "causal": run("causal"),
    }
    results = {name: s.result(900) for name, s in started.items()}
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stdout[-3000:] + result.stderr[-3000:])
    assert "cp 2 all-to-all" in results["cp2"].stdout + results["cp2"].stderr
    assert "cp 2 ring" in results["cp2_ring"].stdout + results["cp2_ring"].stderr
    one, causal = (parse_losses(results[n].stdout) for n in ("one", "causal"))
    for name in ("cp2", "cp2_ring"):
        got = parse_losses(results[name].stdout)
        assert sorted(one) == sorted(got) == list(range(1, STEPS + 1))
        for step in one:
            assert got[step] == pytest.approx(one[step], abs=TOLERANCE), (name, step, one, got)
    # The mask matters on this data (step 1 starts from the same weights: it differs too).
    assert max(abs(causal[s] - one[s]) for s in one) > 50 * TOLERANCE, (one, causal)


RING = [
    "--parallelism.context_parallel_degree",
    "2",
    "--parallelism.context_parallel_style",
    "ring",
]


def test_a_ring_run_over_documents_resumes_exactly_and_on_another_cp_degree(
    tmp_path, debug_args, packed_dataset
):
    args = [
        *fp32_args(debug_args, packed_dataset),
        *("--training.steps", str(STEPS), "--model.attn_mask_type", "block_causal"),
        *("--checkpoint.enable", "--checkpoint.interval", "3"),
    ]

    def run(folder, *extra: str, nproc: int):
        started = start_cli([*args, *extra, "--job.dump_folder", str(folder)], nproc=nproc)
        result = started.result(900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return parse_losses(result.stdout)

    whole = run(tmp_path / "ring", *RING, nproc=2)
    assert sorted(whole) == list(range(1, STEPS + 1))
    # As if the job had died after step 3's checkpoint: the same command resumes from it.
    saved = tmp_path / "ring" / "checkpoint"
    assert (saved / "step-3").is_dir() and (saved / f"step-{STEPS}").is_dir()
    shutil.copytree(saved / "step-3", tmp_path / "after-3" / "checkpoint" / "step-3")
    shutil.rmtree(saved / f"step-{STEPS}")
    resumed = run(tmp_path / "ring", *RING, nproc=2)
    assert sorted(resumed) == list(range(4, STEPS + 1))
    for step in resumed:  # the same layout, the same sums in the same order: bit for bit
        assert resumed[step] == whole[step], (step, whole, resumed)
    # Step 3's ring checkpoint resumed on one process: the data loader's position and the
    # weights carry over, so the next samples and losses are the ring run's.
    alone = run(tmp_path / "after-3", nproc=1)
    assert sorted(alone) == list(range(4, STEPS + 1))
    for step in alone:
        assert alone[step] == pytest.approx(whole[step], abs=TOLERANCE), (step, whole, alone)
