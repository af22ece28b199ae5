"""The small contracts through which Titan's packages meet without importing each other.

titan-models describes a model with a `ModelSpec`; titan-parallel reads the model's
`TPPlan`, its mixture-of-experts layers' `MoEPlan`s and its block container; titan-ckpt reads
its `HFAdapter` (box by box: `SlicedHFAdapter`); titan-data is found through a `DataSpec`;
Float8 and friends are `Converter`s; checkpoint packages provide a `Checkpointer`; optimizer
packages an `OptimizerFactory`.
Everything here is plain data or a `typing.Protocol`: a third-party package satisfies it
without inheriting from anything of ours. A protocol's optional members are declared in it too,
and a base class beside it (`LoaderBase`, `OptimizerPlugin`, `CheckpointerPlugin`) supplies
their defaults: a plugin either implements every member or inherits the base, and a trainer
calls each member without probing for it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

# ----------------------------------------------------------------------------- models

TPStyle = Literal[
    "embedding",  # nn.Embedding sharded on the vocabulary; output replicated, or sequence-sharded with SP
    "colwise",  # nn.Linear sharded on its output features; input replicated
    "rowwise",  # nn.Linear sharded on its input features; output all-reduced (or reduce-scattered with SP)
    "sequence_parallel",  # a norm that runs on sequence-sharded activations when SP is on
    "block_input",  # a module (attention, feed-forward) whose first input is gathered from sequence shards
    "output",  # the final projection: colwise, logits vocab-sharded for loss parallel or gathered
    "per_head",  # a module applied to each head of [batch, seq, heads, head_dim] (QK-norm): weights replicated, gradients summed over the ranks' heads
    "head_shared",  # a module whose output each rank combines with its own heads only (MLA's rotary key): weights replicated, the output's gradient summed over the ranks
    "per_token",  # a module applied to each position alone whose output enters a block (multi-token prediction's eh_proj): weights replicated, run on the sequence shards with SP, output a plain shard
]
"""How one submodule is split across the tensor-parallel group (see `TPPlan`)."""


@dataclass(frozen=True)
class TPPlan:
    """A model's tensor-parallel plan, as data.

    Keys are module names relative to the model root (`root`) or to each repeated block
    (`block`); values are `TPStyle`s. titan-parallel turns the styles into torch's
    `ParallelStyle`s, honouring sequence parallel and loss parallel switches, so a model
    author never imports torch.distributed.tensor.parallel.

    Modules with per-head state must reshape with `-1` for the head count so that they work
    with the local (sharded) number of heads.
    """

    root: Mapping[str, TPStyle] = field(default_factory=dict)
    block: Mapping[str, TPStyle] = field(default_factory=dict)
    blocks: Mapping[str, Mapping[str, TPStyle]] = field(default_factory=dict)
    """Plans of particular blocks, by their key in `layers`, each used instead of `block` for
    that block: a model whose blocks differ (DeepSeek-V3's dense first blocks before the
    mixture-of-experts ones)."""
    divisible_by_tp: Mapping[str, int] = field(default_factory=dict)
    """Sizes that must divide by the TP degree, by name (e.g. {"n_heads": 32, "n_kv_heads": 8})."""


ExpertSplit = Literal[
    "colwise",  # split along the hidden features a weight produces (w1, w3 of a SwiGLU)
    "rowwise",  # split along the hidden features a weight consumes (w2); partial sums result
]
"""How expert tensor parallel splits one weight of a mixture-of-experts layer (see `MoEPlan`)."""


@dataclass(frozen=True)
class MoEPlan:
    """A mixture-of-experts layer's plan, as data: what expert parallel (EP) and tensor
    parallel (TP) need to know to split it. Names are relative to the layer.

    The layer gives it from a `moe_plan()` method; titan-parallel finds every such layer in
    the model's blocks, so a model needs nothing else to get EP. The layer itself routes the
    tokens and weighs the results; parallelism hooks in at three points only:

    - `experts` is called as `experts(x, counts) -> y`: `x` holds the routed token copies
      sorted by expert (`counts[e]` rows for expert e, a 1-D integer tensor of `num_experts`),
      and `y` has one row per row of `x`, in the same order. Its weights named in
      `expert_weights` stack the experts along dimension 0, shaped (experts, in, out), and it
      computes with their local shards (`w.to_local()` when `w` is a DTensor). Under EP the
      call is replaced by: send each row to the rank that holds its expert (all-to-all), run
      the local experts on the rows received (with their own counts), send the results back.
    - `router` returns a tuple whose first element is the routing weights. When
      `weights_scale_outputs` (the experts' outputs are multiplied by them, not their
      inputs), TP sums those weights' gradient over the TP ranks: each rank holds a partial
      sum of every expert output there.
    - under TP the layer receives its tokens gathered along the sequence and returns partial
      sums that are reduced (scattered back along the sequence with sequence parallel).
    """

    num_experts: int
    experts: str = "experts"
    expert_weights: Mapping[str, ExpertSplit] = field(
        default_factory=lambda: {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}
    )
    """The stacked expert weights and how expert TP splits each: colwise along dimension 2
    (out), rowwise along dimension 1 (in)."""
    router: str = "router"
    weights_scale_outputs: bool = True
    shared_experts: Mapping[str, ExpertSplit] = field(default_factory=dict)
    """nn.Linear modules every token goes through (shared experts) and their TP split, e.g.
    {"shared_experts.w1": "colwise", "shared_experts.w2": "rowwise", ...}."""


class ParallelizableModel(Protocol):
    """What titan-parallel and the trainer need from a model.

    `layers` holds the repeated blocks in an `nn.ModuleDict` keyed "0", "1", ...: FSDP,
    activation checkpointing and compile wrap each block, and pipeline parallel deletes the
    blocks a stage does not own while the fully qualified names of the rest stay stable.
    The modules named in `pre_blocks`/`post_blocks` may be set to None by pipeline parallel,
    and `forward` must then pass its input through them unchanged. `post_blocks` may also
    name blocks of `layers` ("layers.K") that `forward` runs after the output projection
    (multi-token-prediction layers): pipeline parallel keeps them on the last stage, and a
    stage without them passes on what they would read.

    Optional: `init_plan()` (initial values as data, which titan-parallel's
    `init_weights_exact` uses to initialise any layout without holding the whole model; see
    `titan_core.init`). A trainer that resumes a model from a checkpoint calls
    `init_buffers(buffer_device)`. Mixture-of-experts layers inside the blocks give their own
    `moe_plan()` (a `MoEPlan`), which expert and tensor parallel read.

    Check a model with `parallelizable_problems(model)`, not `isinstance`: from Python 3.12,
    `isinstance` against a protocol looks members up statically and cannot see an
    `nn.Module`'s submodules (such as `layers`), so this protocol is not runtime-checkable.
    """

    layers: nn.ModuleDict
    pre_blocks: tuple[str, ...]
    post_blocks: tuple[str, ...]

    def tp_plan(self) -> TPPlan: ...

    def cp_buffers(self) -> Mapping[str, int]:
        """Buffers indexed by sequence position (a rotary or positional table), by name as in
        `named_buffers()`, with the dimension that runs along the sequence, e.g.
        `{"rope_cache": 0}`; `{}` when there are none. Context parallel cuts them along that
        dimension together with the tokens, so each rank sees the rows of its own positions;
        each must be exactly as long as the training sequence."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Give every parameter and buffer its initial value (after `to_empty`)."""

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Give every buffer (rotary tables) its value, leaving the parameters as they are:
        after the weights came from a checkpoint."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at this sequence length."""


def parallelizable_problems(model: nn.Module) -> list[str]:
    """What `model` lacks of `ParallelizableModel` (empty when it has everything)."""
    problems = []
    if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
        problems.append("`layers` is not an nn.ModuleDict of the repeated blocks")
    for name in ("pre_blocks", "post_blocks"):
        value = getattr(model, name, None)
        if not (isinstance(value, tuple) and all(isinstance(n, str) for n in value)):
            problems.append(f"`{name}` is not a tuple of module names")
    for name in ("tp_plan", "cp_buffers", "init_weights", "flops_per_token"):
        if not callable(getattr(model, name, None)):
            problems.append(f"`{name}()` is missing")
    return problems


class HFAdapter(Protocol):
    """Converts a model's state dict to and from Hugging Face names and layouts.

    Optional, for checkpoints too large for one process: `to_hf_slices` and `from_hf_slice`
    (see `SlicedHFAdapter`), with which titan-ckpt has each rank read and write only the
    parts of the safetensors files its own shards hold."""

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face loader needs for these weights."""


Box = tuple[slice, ...]
"""A rectangular part of a tensor: one `slice(start, stop)` per dimension (step 1), as a
rank's shard of a sharded parameter is."""


@dataclass(frozen=True)
class HFSlice:
    """A box of one Hugging Face tensor: its name, its full shape and the box (`index`)."""

    name: str
    shape: tuple[int, ...]
    index: Box


class SlicedHFAdapter(HFAdapter, Protocol):
    """An `HFAdapter` that converts one box of one tensor at a time: what each rank needs to
    import or export its own shards without ever holding the whole model.

    `name` is a tensor of ours, `shape` its full (global) shape and `index` the box of it a
    rank holds (a DTensor's local shard: FSDP, TP, EP, or a pipeline stage's whole tensor).
    The conversions are pure rearrangements (renames, transposes, stacking, joining,
    permuting rows), so each element of ours is one element of theirs; a tensor of ours that
    their format has no place for converts to no slices.
    """

    def to_hf_slices(
        self, name: str, shape: tuple[int, ...], index: Box, tensor: torch.Tensor
    ) -> list[tuple[HFSlice, torch.Tensor]]:
        """Where the box `index` of our tensor `name` (its values: `tensor`) goes in Hugging
        Face's tensors: the slices it covers, each with its values. Together the slices of
        every box of a tensor cover its Hugging Face tensors once."""

    def from_hf_slice(
        self,
        name: str,
        shape: tuple[int, ...],
        index: Box,
        read: Callable[[HFSlice], torch.Tensor],
    ) -> torch.Tensor:
        """The box `index` of our tensor `name`, built from the Hugging Face slices that
        `read` returns (only those the box needs, or a little more: whole attention heads).
        `read` raises KeyError for a name the checkpoint lacks."""


def is_sliced_hf_adapter(adapter: object) -> bool:
    """Whether `adapter` converts box by box (`SlicedHFAdapter`)."""
    return callable(getattr(adapter, "to_hf_slices", None)) and callable(
        getattr(adapter, "from_hf_slice", None)
    )


@dataclass(frozen=True)
class ModelSpec:
    """A model family, registered under the `titan.models` entry-point group.

    `build(args)` returns the module; call it under `torch.device("meta")` and materialise
    with `to_empty` + `init_weights`. `flavors` maps names ("debugmodel", "8B", ...) to the
    family's argument dataclass.
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    hf_adapter: Callable[..., HFAdapter] | None = None
    """`hf_adapter(args)` converts the weights of a model built from `args`; a trainer also
    passes `bos_token_id=` and `eos_token_id=` (the tokenizer's, for the config.json it
    writes) when the callable takes them."""
    block_causal_check: Callable[[torch.device, str], list[str]] | None = None
    """For a family whose forward takes `document_ids`: `check(device, impl)` computes its
    block-causal attention on a device as the model does there with implementation `impl` (a
    trainer's `block_causal_impl`: auto, dense, flex, varlen) and compares it with a
    reference, returning one line per disagreement (or per thing the device lacks). A trainer runs it before training with block-causal attention and refuses a
    device where it fails (titan-models: `titan_models.attention.check_block_causal`)."""


def build_hf_adapter(
    spec: ModelSpec, args: Any, *, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> HFAdapter:
    """`spec.hf_adapter(args)`, given the tokenizer's BOS and EOS ids where the family's adapter
    takes them (titan-models' do): a `config.json` without them leaves generation without an
    end."""
    factory = spec.hf_adapter
    if factory is None:
        raise ValueError(f"model {spec.name!r} has no Hugging Face adapter")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no keywords known
        params = {}
    open_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    kwargs = {k: v for k, v in ids.items() if v is not None and (k in params or open_keywords)}
    return factory(args, **kwargs)


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


class CheckpointerFactory(Protocol):
    """What the `titan.checkpointers` entry point names: builds the run's `Checkpointer`, and
    answers two questions before training starts, each as (problems, note)."""

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


class CheckpointerPlugin:
    """The defaults of `CheckpointerFactory`'s optional members, for a factory to inherit: it
    cannot check a checkpoint offline, and does not check its disk. A subclass implements
    `__call__`."""

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
