"""`[training] loss_chunk_tokens`: the debug model trains to the same losses with the chunked
linear + cross-entropy as without it, and the layouts it cannot serve yet are refused."""

from __future__ import annotations

import pytest
from conftest import fp32_args, parse_losses, run_cli

from titan_core import ConfigError, load_config
from titan_trainer.checks import check_config
from titan_trainer.config import JobConfig
from titan_trainer.shipped import find_config_file
from titan_trainer.train import train


def _load(args: list[str]) -> JobConfig:
    return load_config(JobConfig, args, find_config_file=find_config_file)


def test_chunked_loss_trains_like_the_whole_batch_loss(debug_args, same_doc_dataset, tmp_path):
    base = fp32_args(debug_args, same_doc_dataset)
    whole = train(_load(base))
    # 4 x 128 = 512 tokens per microbatch in chunks of 100: the last chunk is short.
    chunked = train(
        _load(
            [
                *base,
                "--job.dump_folder",
                str(tmp_path / "chunked"),
                "--training.loss_chunk_tokens",
                "100",
            ]
        )
    )
    log = (tmp_path / "chunked" / "logs" / "rank_0.log").read_text()
    assert "run 100 tokens at a time" in log, log[-2000:]
    assert len(chunked.losses) == len(whole.losses) == 4
    # float32; the loss sums over tokens in another order, and the weights drift apart by
    # rounding alone over four AdamW steps.
    assert chunked.losses == pytest.approx(whole.losses, abs=1e-5), (chunked.losses, whole.losses)


@pytest.mark.parametrize(
    ("extra", "world", "says"),
    [
        (["--parallelism.tensor_parallel_degree", "2"], 2, "tensor_parallel_degree = 1"),
        (["--parallelism.pipeline_parallel_degree", "2"], 2, "pipeline_parallel_degree = 1"),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"], 1, "n_mtp_layers = 0"),
        (
            ["--compile.enable", "true", "--compile.components", '["model", "loss"]'],
            1,
            'drop "loss"',
        ),
        ([], 1, None),
    ],
)
def test_layouts_the_chunked_loss_cannot_serve_are_refused(debug_args, extra, world, says):
    config = _load([*debug_args, "--training.loss_chunk_tokens", "256", *extra])
    if says is None:
        check_config(config, world)  # the plain layout passes
        return
    with pytest.raises(ConfigError) as e:
        check_config(config, world)
    assert "loss_chunk_tokens = 256" in str(e.value) and says in str(e.value), str(e.value)
    assert "loss_chunk_tokens = 0" in str(e.value)


def test_negative_chunk_is_refused(debug_args):
    with pytest.raises(ConfigError, match="use 0 \\(off\\) or a positive number of tokens"):
        check_config(_load([*debug_args, "--training.loss_chunk_tokens", "-1"]), 1)


def test_chunked_loss_under_fsdp_trains_and_validates_like_one_process(
    debug_args, same_doc_dataset, tmp_path
):
    """Under FSDP the loss reads the output weight after the last group's forward, which FSDP
    keeps gathered; its gradient must reach the reduce-scatter like any other."""
    base = fp32_args(debug_args, same_doc_dataset)
    validation = [
        *("--validation.enable", "true", "--validation.dataset", same_doc_dataset),
        *("--validation.freq", "2", "--validation.steps", "1"),
    ]
    whole = train(_load([*base, *validation]))
    sharded = run_cli(
        [
            *base,
            *validation,
            *("--job.dump_folder", str(tmp_path / "fsdp")),
            *("--parallelism.data_parallel_shard_degree", "2"),
            *("--training.loss_chunk_tokens", "100"),
        ],
        nproc=2,
    )
    said = sharded.stdout + sharded.stderr
    assert sharded.returncode == 0, said[-3000:]
    assert "run 100 tokens at a time" in said
    losses = parse_losses(said)
    # The metric line prints 4 decimals; two ranks reduce in another order than one process.
    assert [losses[s] for s in sorted(losses)] == pytest.approx(whole.losses, abs=2e-4), losses
    whole_log = (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    assert _validation(said) == pytest.approx(_validation(whole_log), abs=2e-4)
    assert len(_validation(said)) == 2


def _validation(text: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if "validation loss" in line
    ]
