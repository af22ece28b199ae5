"""The [parallelism], [activation_checkpoint] and [compile] sections: torchtitan's keys and
defaults, help text, and the problems reported for impossible combinations."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from titan_core.config import ConfigError, field_docs, load_config
from titan_parallel import (
    ActivationCheckpoint,
    Compile,
    FaultToleranceConfig,
    Parallelism,
    check_parallelize_config,
)


@dataclass
class Root:
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)


TORCHTITAN_TOML = """
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 2
disable_loss_parallel = false
enable_async_tensor_parallel = false
context_parallel_degree = 1
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatch_size = 2
expert_parallel_degree = 1

[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"

[compile]
enable = true
components = ["model", "loss"]
"""


def test_torchtitan_toml_loads_unchanged(tmp_path) -> None:
    path = tmp_path / "llama3_debug.toml"
    path.write_text(TORCHTITAN_TOML)
    cfg = load_config(Root, ["--parallelism.enable_sequence_parallel", "false"], toml_path=path)
    assert cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
    assert cfg.parallelism.enable_sequence_parallel is False
    assert cfg.activation_checkpoint.selective_ac_option == "2"
    assert cfg.compile.components == ["model", "loss"]


def test_defaults_follow_torchtitan() -> None:
    p, ac, c = Parallelism(), ActivationCheckpoint(), Compile()
    assert (
        p.data_parallel_shard_degree,
        p.fsdp_reshard_after_forward,
        p.pipeline_parallel_schedule,
    ) == (
        -1,
        "default",
        "1F1B",
    )
    assert (ac.mode, ac.selective_ac_option, c.enable, c.backend) == (
        "selective",
        "op",
        False,
        "inductor",
    )


@pytest.mark.parametrize("cls", [Parallelism, ActivationCheckpoint, Compile, FaultToleranceConfig])
def test_every_field_has_help_text(cls) -> None:
    docs = field_docs(cls)
    assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == []


def test_build_parallel_dims_fills_fsdp_with_the_remaining_ranks() -> None:
    dims = Parallelism(
        tensor_parallel_degree=2, data_parallel_replicate_degree=2
    ).build_parallel_dims(8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)


def test_build_parallel_dims_rejects_degrees_that_do_not_fit() -> None:
    with pytest.raises(ConfigError, match="multiply to 6"):
        Parallelism(data_parallel_shard_degree=3, tensor_parallel_degree=2).build_parallel_dims(4)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (Parallelism(tensor_parallel_degree=0), "tensor_parallel_degree = 0 is not valid"),
        (
            Parallelism(data_parallel_shard_degree=-2),
            "data_parallel_shard_degree = -2 is not valid",
        ),
        (Parallelism(enable_async_tensor_parallel=True), "needs tensor_parallel_degree > 1"),
        (Parallelism(pipeline_parallel_microbatch_size=0), "pipeline_parallel_microbatch_size = 0"),
        (
            ActivationCheckpoint(selective_ac_option="every"),
            'selective_ac_option = "every" is not valid',
        ),
        (ActivationCheckpoint(selective_ac_option="0"), 'selective_ac_option = "0" is not valid'),
        (Compile(components=["model", "optimizer"]), "unknown entries 'optimizer'"),
    ],
)
def test_section_validate_names_key_and_value(section, expected: str) -> None:
    problems = section.validate()
    assert len(problems) == 1 and expected in problems[0], problems


def test_valid_sections_have_no_problems() -> None:
    assert Parallelism(tensor_parallel_degree=2).validate() == []
    assert ActivationCheckpoint(selective_ac_option="3").validate() == []
    assert Compile(enable=True, components=["loss"]).validate() == []


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            dict(
                parallelism=Parallelism(tensor_parallel_degree=2, enable_async_tensor_parallel=True)
            ),
            "needs CUDA",
        ),
        (
            dict(
                parallelism=Parallelism(
                    tensor_parallel_degree=2, enable_async_tensor_parallel=True
                ),
                device_type="cuda",
            ),
            "works through the compiler",
        ),
        (
            dict(
                parallelism=Parallelism(
                    data_parallel_replicate_degree=2,
                    data_parallel_shard_degree=1,
                    tensor_parallel_degree=2,
                )
            ),
            "use HSDP instead",
        ),
        (
            dict(parallelism=Parallelism(data_parallel_shard_degree=1), cpu_offload=True),
            "but FSDP is off",
        ),
    ],
)
def test_combinations_that_cannot_run_are_reported(kwargs: dict, expected: str) -> None:
    problems = check_parallelize_config(**kwargs)
    assert any(expected in p for p in problems), problems


def test_supported_combination_has_no_problems() -> None:
    # compile with tensor parallel runs (titan_parallel.copy_block_inputs): no problem reported
    assert (
        check_parallelize_config(
            Parallelism(tensor_parallel_degree=2), compile=Compile(enable=True)
        )
        == []
    )
    cfg = Parallelism(tensor_parallel_degree=2, data_parallel_replicate_degree=2)
    assert check_parallelize_config(cfg, ActivationCheckpoint(), Compile(), cpu_offload=True) == []
    assert (
        check_parallelize_config(Parallelism(), compile=Compile(enable=True, backend="aot_eager"))
        == []
    )
