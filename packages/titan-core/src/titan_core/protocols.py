"""The small contracts through which Titan's packages meet without importing each other.

titan-models describes a model with a `ModelSpec`, and titan-parallel and the trainer read the
model through `ParallelizableModel` and `TrainableModel` (`titan_core.model_protocols`);
titan-ckpt reads its `HFAdapter` (box by box: `SlicedHFAdapter`, `titan_core.hf_protocols`);
titan-data is found through a `DataSpec`; Float8 and friends are `Converter`s; checkpoint
packages provide a `Checkpointer`; optimizer packages an `OptimizerFactory`; metric sinks
(TensorBoard, W&B) a `MetricSinkFactory`. This module names them all.
Everything here is plain data or a `typing.Protocol`: a third-party package satisfies it
without inheriting from anything of ours. A protocol's optional members are declared in it too,
and a base class beside it (`LoaderBase`, `OptimizerPlugin`, `CheckpointerPlugin`,
`TrainableModelBase`) supplies their defaults: a plugin either implements every member or
inherits the base, and a trainer calls each member without probing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

# The model and Hugging Face contracts live in modules of their own; named here too.
from titan_core.hf_protocols import (  # noqa: F401
    Box,
    HFAdapter,
    HFSlice,
    SlicedHFAdapter,
    is_sliced_hf_adapter,
)
from titan_core.model_protocols import (  # noqa: F401
    DocumentMask,
    ExpertArgs,
    ExpertSplit,
    HeadAttention,
    ModelArgs,
    ModelFeatures,
    ModelSpec,
    MoELayer,
    MoEPlan,
    ParallelizableModel,
    QKClipLayout,
    QKClipRows,
    TPPlan,
    TPStyle,
    TrainableModel,
    TrainableModelBase,
    build_hf_adapter,
    parallelizable_problems,
    replace_run_settings,
    trainable_problems,
)

# ----------------------------------------------------------------------------- data


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@runtime_checkable
class StatefulLoader(Protocol):
    """An iterable of `(inputs, labels)` int64 batches of shape [batch, seq_len] that can be
    checkpointed: after `load_state_dict(sd)` a fresh loader yields exactly the batches that
    followed when `sd` was taken.

    Optional, for a loader whose position is one position of the whole job in a global
    sample order (titan-data's is): `merge_state_dicts(parts)` joins the `state_dict()` of
    every data-parallel rank into that global position, which `load_state_dict` accepts on
    any data-parallel layout. A trainer gathers the parts at save time and hands the
    checkpointer an object whose `state_dict()` is the merged position on every rank and
    which sets `state_is_global = True` (see `GLOBAL_STATE`); a checkpointer then stores one
    copy and restores it whatever the data-parallel degree of the resumed job."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @property
    def skipped_rows(self) -> int:
        """Rows this rank's loader skipped as unusable (bad rows), over its life; the trainer
        logs the sum over the data-parallel ranks."""

    @property
    def tokens_by_source(self) -> Mapping[str, int]:
        """Input tokens the whole job took from each source of a mixture, by label; the
        trainer logs them when there are two sources or more."""

    def close(self) -> None:
        """Stop what the loader started (worker processes); the trainer calls it at the end of
        the run, however it ends."""

    merge_state_dicts: Callable[[list[dict[str, Any]]], dict[str, Any]] | None
    """None, or (for a loader whose position is one of the whole job) the method joining every
    data-parallel rank's `state_dict()` into that global position (see above)."""


class LoaderBase:
    """The defaults of `StatefulLoader`'s optional members, for a loader to inherit: no rows
    skipped, no mixture to report, nothing to close, a state of this rank's only."""

    merge_state_dicts: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None

    @property
    def skipped_rows(self) -> int:
        return 0

    @property
    def tokens_by_source(self) -> Mapping[str, int]:
        return {}

    def close(self) -> None:
        pass


@runtime_checkable
class NamesItsOption(Protocol):
    """An error a plugin raises whose advice names the setting to change (titan-data's
    `MissingTextField` names `text_field`): `for_option(name)` is the same error naming the
    caller's own setting instead (a config key such as `[training] dataset_text_field`)."""

    def for_option(self, option: str) -> Exception: ...


GLOBAL_STATE = "state_is_global"
"""Attribute of a `Stateful` whose `state_dict()` is the same on every rank and fits any
data-parallel layout (a loader's merged global position): checkpointers store it once and
restore it when the data-parallel degree changed."""


@dataclass(frozen=True)
class DataSpec:
    """A data package, registered under the `titan.data` entry-point group.

    `build_tokenizer(name_or_path)` and `build_dataloader(...)` take plain arguments; a
    plugin's `build_dataloader` takes every keyword argument titan-data's README lists (the
    ones the trainer passes), or `**kwargs`.
    """

    name: str
    build_tokenizer: Callable[..., Tokenizer]
    build_dataloader: Callable[..., StatefulLoader]
    describe_dataset: Callable[[str, str | None], str] | None = None
    """Optional: resolve a dataset name and path without reading it (no download) and return
    a one-line description, or raise ValueError/FileNotFoundError saying what is wrong. Lets
    a trainer reject a bad dataset before it starts any process."""
    check_dataset: Callable[[str, str | None], None] | None = None
    """Optional: open the dataset and read its first document (a hub dataset's first shard),
    raising an error whose message names the dataset, why it cannot be read (no network, no
    token, not in the cache, ...) and how to fix it. A trainer calls it once per job before
    any process group exists."""


# ----------------------------------------------------------------------------- converters


@runtime_checkable
class Converter(Protocol):
    """Swaps modules of a model built on the meta device (e.g. nn.Linear -> Float8Linear),
    before any parallelism is applied. Registered under `titan.converters`."""

    def convert(self, model: nn.Module) -> None: ...

    def post_optimizer_hook(self, model: nn.Module) -> None:
        """Called by the trainer after every optimizer step (e.g. to precompute scales)."""


# ----------------------------------------------------------------------------- optimizers


class OptimizerFactory(Protocol):
    """Builds an optimizer. Registered under `titan.optimizers` (or named as `module:attr`).

    `config` is the trainer's `[optimizer]` section: `lr`, `beta1`, `beta2`, `eps`,
    `weight_decay`, `implementation`, `state_dtype`, and sub-sections such as
    `[optimizer.ranger21]`. `total_steps` is the run's length (for an optimizer that schedules
    itself); `dims` is the run's `ParallelDims`, with its meshes built (for an optimizer that
    reduces statistics across ranks). Return an optimizer whose `param_groups[i]["lr"]` the
    trainer's LR schedule may set; an optimizer that schedules its own learning rate is a
    `SelfSchedulingOptimizer`, and then the trainer's schedule is not applied.
    """

    def __call__(
        self, params: list[nn.Parameter], config: Any, *, total_steps: int, dims: Any
    ) -> torch.optim.Optimizer: ...

    def state_copies(self, config: Any) -> float:
        """The state the optimizer `config` describes keeps per parameter, in parameter-sized
        float32 copies (Adam's two moments: 2; in bfloat16: 1). A trainer sizes the run's
        memory and checkpoints with it before anything is built."""


class OptimizerPlugin:
    """The defaults of `OptimizerFactory`'s optional members, for a factory to inherit: the
    state of Adam (two moments, in `config.state_dtype`). A subclass implements `__call__`."""

    def __call__(
        self, params: list[nn.Parameter], config: Any, *, total_steps: int, dims: Any
    ) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} builds no optimizer")

    def state_copies(self, config: Any) -> float:
        return 2 * moment_size(config)


def moment_size(config: Any) -> float:
    """One moment of the `[optimizer]` section `config`, in float32 copies of the parameters
    (its `state_dtype`: bfloat16 moments count half)."""
    return 0.5 if config.state_dtype == "bfloat16" else 1.0


@runtime_checkable
class SelfSchedulingOptimizer(Protocol):
    """An optimizer that may schedule its own learning rate (Ranger21 with its warm-up or
    warm-down on): when `owns_lr_schedule` is true, a trainer holds its own schedule at the
    peak instead of applying both."""

    owns_lr_schedule: bool


# ----------------------------------------------------------------------------- checkpoints


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointError(RuntimeError):
    """A checkpointer's refusal that the user can act on: a save that failed (a full disk), no
    usable checkpoint to resume from. Its message names the checkpoint, the reason and the
    fix; the trainer prints it as it is, without a traceback."""


class StateMismatchError(ValueError):
    """Raised by a `Stateful`'s `load_state_dict` for a state that is intact but was saved
    under settings the loading object does not have (a loader's sequence length, say). A
    checkpointer stops on it, naming the setting, instead of trying the older checkpoints of
    the same run (saved under the same settings) and calling them all unusable."""


@runtime_checkable
class Checkpointer(Protocol):
    """Saves and restores the training state. Registered under `titan.checkpointers`.

    The trainer hands it a dict of `Stateful`s (model, optimizer, lr_scheduler, dataloader,
    train_state) when it is built, then calls `load()` once and `save(step)` every step; the
    checkpointer decides from its own config whether a step is due. On a preemption (SIGTERM)
    the trainer calls `save(step, force=True)`: save now, a full checkpoint the run can resume
    from (never a model-only or export-only save).
    """

    def load(self, step: int = -1) -> int | None:
        """Restore the states; return the step restored, or None when there is nothing to load."""

    def save(self, step: int, *, last_step: bool = False, force: bool = False) -> None: ...

    def close(self) -> None:
        """Finish in-flight saves and release resources."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run would resume from, as its checkpointer finds it before training
    (`CheckpointerFactory.resume_point`), without loading it."""

    path: str
    """Where it is (a folder or a URL), as a message or `--checkpoint.initial_load_path`
    names it."""
    config_toml: str | None = None
    """The resolved config of the run that saved it, or None when it keeps none."""
    dp_world_size: int | None = None
    """The data-parallel ranks of the run that saved it, or None when not recorded."""


class CheckpointerFactory(Protocol):
    """What the `titan.checkpointers` entry point names: builds the run's `Checkpointer`, and
    answers three questions before training starts: which checkpoint a resume loads
    (`resume_point`), and, each as (problems, note), whether it fits the run's model and
    whether the run's checkpoints fit their disk."""

    def __call__(
        self,
        config: Any,
        *,
        states: Mapping[str, Any],
        dump_folder: str,
        dims: Any = None,
        config_toml: str = "",
        dp_rank: int | None = None,
        hf_adapter: HFAdapter | None = None,
    ) -> Checkpointer: ...

    def check_loadable(
        self, config: Any, dump_folder: str, expected: Mapping[str, tuple[int, ...]]
    ) -> tuple[list[str], str | None]:
        """Whether the checkpoint a run would resume from holds every model tensor with the
        global shape in `expected` (by name), without loading it; the trainer's dry run asks."""

    def check_space(
        self, config: Any, dump_folder: str, state_bytes: int, steps: int
    ) -> tuple[list[str], str | None]:
        """Whether the checkpoints of a run whose saved state takes `state_bytes` and that
        trains to step `steps` fit on the disk of their folder; the trainer asks before
        training."""

    def resume_point(self, config: Any, dump_folder: str) -> ResumePoint | None:
        """The full checkpoint (not a model-only save) whose state a run with `config`
        ([checkpoint]) would load: the newest complete one in its folder (or `load_step`'s),
        else `initial_load_path` when it resumes a whole run; None when there is none. The
        trainer checks the run's settings against it before training."""


class CheckpointerPlugin:
    """The defaults of `CheckpointerFactory`'s optional members, for a factory to inherit: it
    cannot check a checkpoint offline, does not check its disk, and cannot say which
    checkpoint a resume loads. A subclass implements `__call__`."""

    def __call__(self, config: Any, **kwargs: Any) -> Checkpointer:
        raise NotImplementedError(f"{type(self).__name__} builds no checkpointer")

    def check_loadable(
        self, config: Any, dump_folder: str, expected: Mapping[str, tuple[int, ...]]
    ) -> tuple[list[str], str | None]:
        return [], "this checkpointer cannot check a checkpoint offline"

    def check_space(
        self, config: Any, dump_folder: str, state_bytes: int, steps: int
    ) -> tuple[list[str], str | None]:
        return [], None

    def resume_point(self, config: Any, dump_folder: str) -> ResumePoint | None:
        return None


# ----------------------------------------------------------------------------- metric sinks


@dataclass(frozen=True)
class MetricRun:
    """What a metric sink is told of the run whose scalars it records."""

    dump_folder: str
    run_id: str
    """The run's series: new for a fresh run, kept by its resumes."""
    name: str
    """The run's description (`[job] description`), for a sink that names its runs."""
    config: Mapping[str, Any]
    """The resolved config, as plain data."""
    metrics: Any
    """The trainer's `[metrics]` section (folders and switches of the sinks it names)."""


class MetricSink(Protocol):
    """Where the scalars of each logged step go besides the console line: TensorBoard, W&B,
    or a third-party sink. Built on rank 0 only."""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None:
        """The run ends (however it ended): flush and release."""


class MetricSinkFactory(Protocol):
    """What a `titan.metric_sinks` entry point names: builds the sink of one run."""

    def __call__(self, run: MetricRun) -> MetricSink: ...
