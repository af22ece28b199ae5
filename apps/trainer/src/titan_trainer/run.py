"""What one training run holds (`Run`, built once by `titan_trainer.train.prepare` from named
parts: the model, the data, the optimization, the checkpoints), its progress as the checkpoint
keeps it (`TrainState`) and what it returns (`TrainResult`)."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from titan_core import (
    Converter,
    DataSpec,
    DistInfo,
    ParallelDims,
    StatefulLoader,
    Tokenizer,
)
from titan_parallel import QKClip
from titan_trainer.batch import BatchShape
from titan_trainer.checkpointing.saving import RunCheckpoints
from titan_trainer.config import JobConfig
from titan_trainer.layout import Layout
from titan_trainer.lr_schedule import LRSchedule
from titan_trainer.runtime import ParallelRuntime
from titan_trainer.step import ALONE, StepCoordinator


@dataclass
class TrainState:
    """What the checkpoint needs to know about progress, besides modules and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str = field(default_factory=lambda: new_run_id())
    """Names the run's series of metrics: new for a fresh run, kept (from the checkpoint) by
    its resumes, so that a later run in the same dump folder is never drawn as its sequel."""
    losses: list[float] = field(default_factory=list)
    """Loss per step in this process's lifetime, read back at logging steps (not checkpointed;
    for tests and summaries)."""

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        # Checkpoints written before run ids carry none: their resume starts a series.
        self.run_id = str(state.get("run_id", self.run_id))


def shared_run_id(label: str = "") -> str:
    """A new run id, rank 0's on every rank (any rank's copy may be the one a checkpoint keeps)."""
    run_id = [new_run_id(label)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(run_id, src=0)
    return run_id[0]


def new_run_id(label: str = "") -> str:
    """`20251123-103511-llama3-debugmodel-AdamW-4f2a`: when the run started, what it trains
    (`run_label`), and 16 random bits for runs started in the same second. TensorBoard shows
    the runs of a dump folder by these names."""
    return "-".join(x for x in (time.strftime("%Y%m%d-%H%M%S"), label, secrets.token_hex(2)) if x)


def run_label(config) -> str:
    """`llama3-debugmodel-AdamW`: the model, its flavor and the optimizer, in characters a
    folder name takes anywhere."""
    parts = (config.model.name, config.model.flavor, config.optimizer.name)
    return "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p).strip("_.") for p in parts)


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    losses: list[float]
    stopped_early: bool
    stopped_by: str | None = None
    """What stopped the run before its last step: "SIGTERM" (after saving a checkpoint when
    checkpoints are on) or "SIGINT" (Ctrl-C); None when it finished."""


@dataclass
class RunModel:
    """The model as this rank trains it."""

    runtime: ParallelRuntime
    """How its parts were parallelized, and how a microbatch runs through them."""
    converters: list[Converter]
    """Float8 and friends, whose hooks run after each optimizer step."""
    parts: list[nn.Module]
    """This rank's parts (pipeline stages), parallelized."""


@dataclass
class RunData:
    """Where the run's batches come from."""

    spec: DataSpec
    """The data plugin (validation builds its own loader with it)."""
    tokenizer: Tokenizer
    loader: StatefulLoader


@dataclass
class Optimization:
    """What steps the weights."""

    optimizer: torch.optim.Optimizer
    lr_scheduler: LRSchedule
    qk_clip: QKClip | None = None
    """MuonClip's QK-Clip after each step ([optimizer.muon] qk_clip_tau), when on."""


@dataclass
class Run:
    """Everything one training run holds, built once by `prepare`, in named parts."""

    config: JobConfig
    info: DistInfo
    layout: Layout
    """The dims, the batch and the model family, resolved once."""
    model: RunModel
    data: RunData
    optimization: Optimization
    state: TrainState
    checkpoints: RunCheckpoints
    coordinator: StepCoordinator = ALONE
    """How the steps meet other replica groups ([fault_tolerance]); the plain one does nothing."""

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def batch(self) -> BatchShape:
        return self.layout.batch

    @property
    def dump(self) -> str:
        return self.config.job.dump_folder
