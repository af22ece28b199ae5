"""The data's global order through the trainer: a job resumed on another data-parallel degree
(2 -> 4, then 4 -> 1 with pipeline parallel) trains on exactly the global batches the
uninterrupted job saw, token for token. Every rank records the microbatches its loader yields
(tests/record_data.py); a step's global batch is every data-parallel rank's microbatches in
rank order. The data is a weighted mixture of the embedded corpus, local jsonl files and a
folder of tokens, read by a worker process, and the metrics line reports each source's tokens.
Attention is block-causal in every run, so the resumed runs' losses, equal to the
uninterrupted run's, also show the document mask at work under FSDP and pipeline stages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import parse_losses, run_cli

from titan_data.pretokenize import tokenize_source

G = 8  # samples per optimizer step, kept when the data-parallel degree changes
pytestmark = pytest.mark.timeout(900)


def global_batches(folder: Path, first_step: int) -> dict[int, torch.Tensor]:
    """step -> [G, seq] from the recordings of one run (one file per data-parallel rank; of
    the files of a rank's tensor-parallel peers, which hold the same batches, the first)."""
    per_rank: dict[int, list] = {}
    for path in sorted(folder.glob("dp*-rank*.jsonl")):
        dp = int(path.name.split("-")[0][2:])
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        per_rank.setdefault(dp, rows)
    ranks = len(per_rank)
    microbatches = {dp: len(rows) for dp, rows in per_rank.items()}
    assert len(set(microbatches.values())) == 1, microbatches
    local = len(per_rank[0][0])
    accumulation = G // (local * ranks)
    steps = microbatches[0] // accumulation
    out = {}
    for s in range(steps):
        parts = [
            torch.tensor(per_rank[dp][s * accumulation + m])
            for dp in range(ranks)
            for m in range(accumulation)
        ]
        out[first_step + s] = torch.cat(parts)
    return out


def test_resuming_on_another_data_parallel_degree_trains_on_the_same_global_batches(
    debug_args, tmp_path
):
    docs = tmp_path / "docs"
    docs.mkdir()
    for part in range(3):
        (docs / f"part-{part}.jsonl").write_text(
            "".join(
                json.dumps({"text": f"part {part} document {i}: " + "words " * (i % 17 + 3)}) + "\n"
                for i in range(40)
            )
        )
    tokens = tmp_path / "tokens"
    tokenize_source(
        dataset=str(docs), dataset_path=None, tokenizer="byte", out=str(tokens), shard_tokens=900,
        progress=False,
    )  # fmt: skip
    common = [
        *debug_args,
        "--training.dataset", f"pydocs:2,{docs}:1,{tokens}:1",
        "--training.data_plugin", "record_data:data_spec",
        "--training.seq_len", "32",
        "--training.local_batch_size", "2",
        "--training.global_batch_size", str(G),
        "--training.mixed_precision_param", "float32",
        "--training.dataloader.num_workers", "1",
        "--model.attn_mask_type", "block_causal",
        "--metrics.enable_tensorboard", "false",
        "--metrics.peak_tflops", "1",
        # Every run plans the same 6 steps, so that the learning-rate schedule is the same.
        "--training.steps", "6",
        "--checkpoint.enable",
        "--checkpoint.last_save_model_only", "false",
    ]  # fmt: skip

    def run(name: str, nproc: int, *args: str):
        result = run_cli(
            [*common, "--job.dump_folder", str(tmp_path / name), *args],
            nproc=nproc,
            env_extra={
                "RECORD_DIR": str(tmp_path / "records" / name),
                "PYTHONPATH": str(Path(__file__).parent),  # where record_data lives
            },
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result

    # Uninterrupted: 2 data-parallel ranks, 2 microbatches of 2 samples each per step.
    whole = run("whole", 2, "--checkpoint.interval", "3")
    # After 6 steps of 8 samples of 32 tokens, in shares 2:1:1.
    assert "| tokens pydocs 768, docs 384, tokens 384" in whole.stdout
    assert "block-causal attention matches its reference on cpu" in whole.stdout
    reference = global_batches(tmp_path / "records" / "whole", 1)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]
    assert len({tuple(b[:, :4].flatten().tolist()) for b in reference.values()}) == 6

    # 2 -> 4 data-parallel ranks (one microbatch each) from the step-3 checkpoint.
    four = run(
        "four", 4,
        "--checkpoint.interval", "5",
        "--checkpoint.initial_load_path", str(tmp_path / "whole" / "checkpoint" / "step-3"),
        "--checkpoint.initial_load_model_only", "false",
    )  # fmt: skip
    assert "step-3 (dataloader, lr_scheduler, model, optimizer, rng, train_state)" in four.stdout
    got = global_batches(tmp_path / "records" / "four", 4)
    assert sorted(got) == [4, 5, 6]
    for step, batch in got.items():
        assert torch.equal(batch, reference[step]), f"step {step} differs on 4 ranks"
    losses = parse_losses(whole.stdout)
    # fp32; the same weights, optimizer state and samples, summed in another order over the
    # ranks: the printed losses (4 decimals) agree to 2e-4.
    for step, loss in parse_losses(four.stdout).items():
        assert abs(loss - losses[step]) < 2e-4, (step, loss, losses[step])

    # 4 -> 1 data-parallel rank, the model in 2 pipeline stages (stage 2 gets the document
    # ids with its microbatches), from the 4-rank run's step-5 checkpoint.
    one = run(
        "one", 2,
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.pipeline_parallel_degree", "2",
        "--checkpoint.initial_load_path", str(tmp_path / "four" / "checkpoint" / "step-5"),
        "--checkpoint.initial_load_model_only", "false",
    )  # fmt: skip
    assert "step-5 (dataloader, lr_scheduler, model, optimizer, rng, train_state)" in one.stdout
    got = global_batches(tmp_path / "records" / "one", 6)
    assert sorted(got) == [6]
    assert torch.equal(got[6], reference[6]), "step 6 differs on 1 data-parallel rank"
    assert abs(parse_losses(one.stdout)[6] - losses[6]) < 2e-4
