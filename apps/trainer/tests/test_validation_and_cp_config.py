"""Validation's defaults and limits, and how the trainer finds a model's context-parallel
buffers; everything that needs no process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from titan_core import ConfigError, load_config
from titan_trainer.checks import check_config
from titan_trainer.config import JobConfig
from titan_trainer.parallel import _cp_buffers


def problems(args: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(JobConfig, args), world_size)
    return str(info.value)


def test_validation_defaults_to_the_held_out_split_at_the_training_length():
    from titan_data import pydocs_documents

    config = load_config(JobConfig, ["--validation.enable", "true"])
    assert config.validation.dataset == "pydocs_validation" != config.training.dataset
    assert config.validation.seq_len == -1  # the training sequence length
    check_config(config, 1)
    assert not set(pydocs_documents("validation")) & set(pydocs_documents("train"))


def test_validation_longer_than_training_is_refused_before_the_job_starts():
    assert problems(
        [
            "--validation.enable",
            "true",
            "--validation.seq_len",
            "4096",
            "--training.seq_len",
            "2048",
        ]
    ) == (
        "titan: config error: [validation] seq_len = 4096 must be at most [training] seq_len = 2048"
        " (the model's positional table is that long)\n"
        "       use -1 to validate at the training sequence length"
    )


def test_validation_under_context_parallel_must_use_the_training_length():
    message = problems(
        [
            *("--validation.enable", "true", "--validation.seq_len", "1024"),
            *("--training.seq_len", "2048", "--parallelism.context_parallel_degree", "2"),
        ],
        world_size=2,
    )
    assert "[validation] seq_len = 1024 must be equal to [training] seq_len = 2048" in message
    assert "context parallel shards it with the batch" in message


def test_validation_under_pipeline_parallel_takes_the_training_shapes():
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--validation.enable", "true"]
    check_config(load_config(JobConfig, [*pp, "--validation.local_batch_size", "16"]), 2)
    message = problems(
        [*pp, "--validation.seq_len", "1024", "--validation.local_batch_size", "4"], world_size=2
    )
    assert (
        "[validation] seq_len = 1024 must equal [training] seq_len = 2048 under pipeline parallel"
        in message
    ), message
    assert (
        "[validation] local_batch_size = 4 must be a multiple of [training] local_batch_size = 8"
        in message
    ), message
    assert "use 8 or a multiple of it" in message


def test_validation_under_a_v_schedule_is_refused_before_start_up():
    """The V schedules keep two neighbouring stages on one rank, whose hand-off torch's
    forward-only schedule runs as in training and fails: refused with the fix, before any
    process group; another schedule passes the same check."""
    from titan_trainer.preflight import preflight_problems

    base = [
        *("--validation.enable", "true"),
        *("--parallelism.pipeline_parallel_degree", "2"),
        *("--parallelism.data_parallel_shard_degree", "1"),
    ]
    v = load_config(JobConfig, [*base, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    found, _, _ = preflight_problems(v, 2, dry_run=True)
    assert any(
        p.startswith(
            "[validation] enable = true: a forward-only pass (validation) does not run"
            " under the ZBVZeroBubble pipeline schedule: pipeline rank 1 holds the"
            " neighbouring stages 1 and 2"
        )
        and "use a schedule that keeps neighbouring stages on different ranks" in p
        for p in found
    ), found
    interleaved = [*base, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    found, _, _ = preflight_problems(load_config(JobConfig, interleaved), 2, dry_run=True)
    assert not [p for p in found if "forward-only" in p], found
    # [eval] scores through the same forward-only schedule: refused alike.
    task = str(Path(__file__).resolve().parents[1] / "tasks" / "pydocs_piqa.toml")
    scored = [*base[2:], "--eval.tasks", task, "--parallelism.pipeline_parallel_schedule"]
    found, _, _ = preflight_problems(
        load_config(JobConfig, [*scored, "ZBVZeroBubble"]), 2, dry_run=True
    )
    assert any(p.startswith("[eval] tasks: a forward-only pass") for p in found), found


class _Positional(nn.Module):
    def __init__(self, names: dict[str, int] | None) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(4, 2))
        if names is not None:
            self.cp_buffers = lambda: names


def test_cp_buffers_come_from_the_model_and_are_checked():
    assert _cp_buffers(_Positional({"table": 0})) == {"table": 0}
    assert _cp_buffers(_Positional({})) == {}
    with pytest.raises(TypeError, match=r"_Positional has no cp_buffers\(\); context parallel"):
        _cp_buffers(_Positional(None))
    with pytest.raises(ValueError, match=r"names rope, which is not a buffer .*its buffers: table"):
        _cp_buffers(_Positional({"rope": 0}))


def test_llama_declares_its_rope_table_for_context_parallel():
    from titan_core.protocols import parallelizable_problems
    from titan_models.llama3 import Transformer, llama3_flavors

    with torch.device("meta"):
        model = Transformer(llama3_flavors["debugmodel"])
    assert parallelizable_problems(model) == []
    assert _cp_buffers(model) == {"rope_cache": 0}
