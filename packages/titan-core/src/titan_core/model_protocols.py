"""What a model tells the packages that parallelize and train it, declared here so that they
never probe it: its parallel plans as data (`TPPlan`, `MoEPlan`, `ParallelizableModel`: what
titan-parallel reads), what a trainer reads besides (`TrainableModel`: its arguments, its
initialisation as data, its FLOPs, the SDPA kernel of its causal attention; `MoELayer`: how its
experts are balanced), and the family that builds it (`ModelSpec`: its flavors as `ModelArgs`, the
`ModelFeatures` its models take, how a run's settings reach its arguments, its Hugging Face
adapter).

Everything here is plain data or a `typing.Protocol`: a third-party family satisfies it
without inheriting from anything of ours; `TrainableModelBase` supplies the defaults of the
members a model without a kernel choice has no use for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn

from titan_core.hf_protocols import HFAdapter
from titan_core.init import ParamInit

# ----------------------------------------------------------------------------- parallel plans

TPStyle = Literal[
    "embedding",  # nn.Embedding sharded on the vocabulary; output replicated, or sequence-sharded with SP
    "colwise",  # nn.Linear sharded on its output features; input replicated
    "rowwise",  # nn.Linear sharded on its input features; output all-reduced (or reduce-scattered with SP)
    "sequence_parallel",  # a norm that runs on sequence-sharded activations when SP is on
    "block_input",  # a module (attention, feed-forward) whose first input is gathered from sequence shards
    "output",  # the final projection: colwise, logits vocab-sharded for loss parallel or gathered
    "per_head",  # a module applied to each head of [batch, seq, heads, head_dim] (QK-norm): weights replicated, gradients summed over the ranks' heads
    "head_shared",  # a module whose output each rank combines with its own heads only (MLA's rotary key): weights replicated, the output's gradient summed over the ranks
    "per_head_param",  # a module whose parameters hold one entry per query head on dim 0 (attention sinks) and which returns them: sharded by heads like the projections, each rank reads its own
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
    output_bias: str | None = None
    """A module of the layer whose output the layer adds to its combined expert outputs
    (GPT-OSS's per-expert down-projection biases, weighted by the routing). Under TP its
    weights become replicated DTensors and its `share` attribute 1/tp: it multiplies its
    output by `share` and reads its weights with `to_local(grad_placements=[Partial()])`, so
    that the ranks' partial sums count it once and its gradient is summed over them."""


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


class HeadAttention:
    """An attention layer, for a model's attention modules to inherit: its `attend(q, k, v,
    mask)` attends each query head on its own over the whole sequence, `[batch, heads, seq,
    head_dim]` in and out (keys and values may have fewer heads: kv head i serves query heads
    i*r .. (i+1)*r-1), and `mask` is what the model's forward built for the whole sequence
    (None: causal). All-to-all context parallel (titan-parallel) finds the layers by this
    class and gives `attend` the whole sequence of a share of the heads; a layer that does not
    inherit it is never changed. Declared by inheritance, so that the layers are found by what
    they are, not by a method's name."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.attend")

    def attention_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) before tensor parallel splits them."""
        raise NotImplementedError(f"{type(self).__name__}.attention_heads")

    def qk_clip_layout(self) -> QKClipLayout:
        """Where its heads' logits come from, for QK-Clip (titan-parallel's `QKClip`): the
        softmax scale of `attend` and the rows of its query and key projections, by head.
        Called after parallelize (the weights may then be DTensors)."""
        raise NotImplementedError(f"{type(self).__name__}.qk_clip_layout")


QKClipRole = Literal["q", "q_alone", "k", "none"]
"""What rows of a projection are to a head's logit, for QK-Clip: `q`, a query part whose key
part is scaled too; `q_alone`, a query part whose key part is shared by every head and left as
it is (MLA's rotary query); `k`, a key part (grouped by key/value head); `none`, neither (MLA's
values in `wkv_b`)."""


@dataclass(frozen=True)
class QKClipRows:
    """One projection weight (`[out, in]`, nn.Linear's) whose output rows are per head: a
    block of rows for each query head (`per = "query"`) or key/value head (`per = "kv"`), in
    head order, each block made of `parts`, (role, rows) in order."""

    weight: torch.Tensor
    per: Literal["query", "kv"]
    parts: tuple[tuple[QKClipRole, int], ...]


@dataclass(frozen=True)
class QKClipLayout:
    """An attention layer's softmax `scale` (its logits are q . k x scale) and the
    projections that make its heads' queries and keys (`QKClipRows`)."""

    scale: float
    rows: tuple[QKClipRows, ...]
    window: int | None = None
    """The layer's sliding window (a query sees that many positions, its own included): only
    those pairs' logits count; None: every earlier position."""


class DocumentMask:
    """A block-causal mask that keeps the document ids it was made from, for a model's mask
    type to inherit: `document_ids` (`[batch, seq]`, the whole sequence's, each document a run
    of equal ids; None where the mask was made without them). Ring context parallel over packed
    documents (titan-parallel) builds each pair of chunks' mask itself, from the ids of the
    rows the layer is given (a pipeline's microbatch, say), and reads them here."""

    document_ids: torch.Tensor | None = None


# ----------------------------------------------------------------------------- what a trainer reads


class ExpertArgs(Protocol):
    """What a trainer reads of a flavor's mixture of experts (titan-models' `MoEArgs`)."""

    capacity_factor: float | None
    """In training each expert takes at most this times its even share (None: no limit); the
    trainer then reports the share of choices re-routed."""
    router_centering: bool
    """The router reads its input less a center saved with the weights (which Hugging Face's
    formats have no place for)."""
    router_selection: str
    """How training ranks each token's experts (`topk`, `sinkhorn`)."""
    load_balance_coeff: float | None
    """The step of the experts' selection bias after each optimizer step (None: no bias)."""


class ModelArgs(Protocol):
    """One flavor of a family as a trainer reads it: a frozen dataclass, which the family's
    `ModelSpec.configure` gives a run's vocabulary, sequence length and `[model]` settings.
    titan-models' `DecoderArgs` has every member."""

    vocab_size: int
    """Rows of the embedding table."""
    max_seq_len: int
    """Positions the model has (its rotary table's rows)."""
    n_mtp_layers: int
    """Multi-token-prediction layers (0: none)."""
    moe: ExpertArgs | None
    """The mixture of experts of its blocks (None: a dense model)."""


@dataclass(frozen=True)
class ModelFeatures:
    """What the models of a family take from a trainer beyond their arguments, declared by the
    family (`ModelSpec.features`) so that a trainer checks a run against them before it
    builds anything. The defaults: none of them."""

    document_ids: bool = False
    """`forward(tokens, document_ids=...)` attends only within each packed document
    (block-causal attention)."""
    block_causal_impl: bool = False
    """How its block-causal mask is computed can be chosen (the args' `block_causal_impl`)."""
    sdpa_backend: bool = False
    """Its causal attention runs on an SDPA kernel a trainer may choose
    (`TrainableModel.sdpa_heads`, `set_sdpa_backend`)."""
    mtp: bool = False
    """It has multi-token-prediction layers when its args' `n_mtp_layers` asks for them."""


class MoELayer(Protocol):
    """A mixture-of-experts layer (a module in the blocks that gives `moe_plan()`, as
    titan-parallel finds them) as a trainer balances and reports it (titan-models' `MoE`)."""

    args: ExpertArgs
    aux_loss_scale: float
    """Weight of the auxiliary balance loss's gradient (1/N under N forwards per step)."""
    tokens_rerouted: torch.Tensor
    """Token-expert choices a capacity re-routed since the last `update_expert_bias`."""

    def step_sums(self) -> torch.Tensor:
        """What the ranks that share the layer's weights sum after a step (the tokens per
        expert, and the router inputs with router centering)."""

    def update_expert_bias(
        self, group: Any = None, *, sums: torch.Tensor | None = None
    ) -> torch.Tensor:
        """After the optimizer step: move the balancing state from `sums` (the summed
        `step_sums()`); returns the tokens each expert received."""


class TrainableModel(ParallelizableModel, Protocol):
    """What a trainer needs of a model beyond parallelizing it: the arguments it was built
    from, its initialisation as data, and the SDPA kernel of its causal attention
    (`sdpa_heads` is asked only of a family whose `ModelFeatures.sdpa_backend` is set). Its
    mixture-of-experts layers are `MoELayer`s. Check a model with `trainable_problems(model)`."""

    args: ModelArgs

    def init_plan(self) -> Mapping[str, ParamInit]:
        """Each parameter's initial value as data, by fully qualified name (every block's,
        also those a pipeline stage does not hold; see `titan_core.init`)."""

    def sdpa_heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size) of the attention whose kernel
        `set_sdpa_backend` chooses, before tensor parallel splits the heads."""

    def set_sdpa_backend(self, choice: Any) -> int:
        """Run causal attention with `choice` (a kernel of
        `titan_models.attention_backend`; None: torch's dispatch); returns how many layers
        took it."""


class TrainableModelBase:
    """The defaults of `TrainableModel`'s members that a model without a kernel choice has no
    use for, for a model to inherit: no attention whose kernel can be chosen."""

    def sdpa_heads(self) -> tuple[int, int, int]:
        raise NotImplementedError(f"{type(self).__name__} has no attention kernel to choose")

    def set_sdpa_backend(self, choice: Any) -> int:
        return 0


def trainable_problems(model: nn.Module) -> list[str]:
    """What `model` lacks of `TrainableModel` (empty when it has everything), for an error that
    names each member; like `parallelizable_problems`, since `isinstance` cannot see an
    `nn.Module`'s members."""
    problems = parallelizable_problems(model)
    if not dataclasses.is_dataclass(getattr(model, "args", None)):
        problems.append("`args` is not the dataclass of arguments the model was built from")
    for name in ("init_plan", "init_buffers", "sdpa_heads", "set_sdpa_backend"):
        if not callable(getattr(model, name, None)):
            problems.append(f"`{name}()` is missing")
    return problems


def replace_run_settings(args: Any, options: Any, *, vocab_size: int, seq_len: int) -> Any:
    """The default `ModelSpec.configure`: the flavor's args with the run's vocabulary and
    sequence length; a family without settings of its own ignores `options`."""
    return dataclasses.replace(args, vocab_size=vocab_size, max_seq_len=seq_len)


@dataclass(frozen=True)
class ModelSpec:
    """A model family, registered under the `titan.models` entry-point group.

    `build(args)` returns the module (a `TrainableModel`); call it under
    `torch.device("meta")` and materialise with `to_empty` + `init_weights`. `flavors` maps
    names ("debugmodel", "8B", ...) to the family's arguments (`ModelArgs`).
    """

    name: str
    flavors: Mapping[str, ModelArgs]
    build: Callable[[Any], nn.Module]
    hf_adapter: Callable[..., HFAdapter] | None = None
    """`hf_adapter(args, bos_token_id=None, eos_token_id=None)` converts the weights of a
    model built from `args`; a trainer passes the tokenizer's ids for the config.json it
    writes."""
    block_causal_check: Callable[[torch.device, str], list[str]] | None = None
    """For a family whose forward takes `document_ids`: `check(device, impl)` computes its
    block-causal attention on a device as the model does there with implementation `impl` (a
    trainer's `block_causal_impl`: auto, dense, flex, varlen) and compares it with a
    reference, returning one line per disagreement (or per thing the device lacks). A
    trainer runs it before training with block-causal attention and refuses a device where it
    fails (titan-models: `titan_models.attention.check_block_causal`)."""
    features: ModelFeatures = field(default_factory=ModelFeatures)
    """What the family's models take from a trainer beyond their arguments."""
    configure: Callable[..., ModelArgs] = replace_run_settings
    """`configure(args, options, vocab_size=, seq_len=)`: a flavor's args for a run, with its
    vocabulary, sequence length and the model settings `options` (a trainer's `[model]`
    section; titan-models reads its `ModelOptions` there)."""


def build_hf_adapter(
    spec: ModelSpec, args: Any, *, bos_token_id: int | None = None, eos_token_id: int | None = None
) -> HFAdapter:
    """`spec.hf_adapter(args)` given the tokenizer's BOS and EOS ids: a `config.json` without
    them leaves generation without an end."""
    if spec.hf_adapter is None:
        raise ValueError(f"model {spec.name!r} has no Hugging Face adapter")
    return spec.hf_adapter(args, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
