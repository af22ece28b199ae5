"""A small but complete config tree in the shape of a trainer's, for the machinery tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from titan_core import Comm, ConfigError, Job


@dataclass
class Training:
    steps: int = 10
    """Optimizer steps to run."""
    seq_len: int = 2048
    """Tokens per sample."""
    max_norm: float = 1.0
    """Gradient clipping norm."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype for compute."""
    compile: bool = False
    """Compile the model."""
    dataset_path: str | None = None
    """Local copy of the dataset."""

    def validate(self) -> list[str]:
        if self.steps < 1:
            return [f"[training] steps = {self.steps} is not valid\nrun at least 1 step"]
        return []


@dataclass
class Model:
    name: str = "llama3"
    """Model family."""
    converters: list[str] = field(default_factory=list)
    """Converters to apply."""


@dataclass
class Float8:
    recipe_name: str | None = None
    """Float8 recipe."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Modules left in high precision."""


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 fills the rest."""
    tensor_parallel_degree: int = 1
    """TP degree."""
    pipeline_parallel_microbatch_size: int = 1
    """Microbatch size."""


@dataclass
class Root:
    job: Job = field(default_factory=Job)
    comm: Comm = field(default_factory=Comm)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    quantize: Quantize = field(default_factory=Quantize)


@pytest.fixture
def root_cls():
    return Root


def config_error(cls, args=(), toml_path=None) -> str:
    from titan_core import load_config

    with pytest.raises(ConfigError) as info:
        load_config(cls, args, toml_path=toml_path)
    return str(info.value)


@pytest.fixture(scope="session")
def single_process_group():
    import torch.distributed as dist

    from titan_core import init_distributed

    info = init_distributed("cpu")
    yield info
    dist.destroy_process_group()
