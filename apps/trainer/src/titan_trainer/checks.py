"""Checks that need more than one section, or the job's size: run before any process group
exists, so a bad combination costs seconds, not a queue slot. The checks that need the
tokenizer, the datasets and the whole model are `titan_trainer.preflight`'s."""

from __future__ import annotations

import difflib
import time

import torch

import titan_parallel
from titan_core import (
    ConfigError,
    HeadAttention,
    ModelArgs,
    ModelSpec,
    ParallelDims,
    PluginError,
    any_rank,
    device_name,
    get_logger,
    parallelizable_problems,
    plugins,
    resolve,
)
from titan_parallel.expert_parallel import tp_plan_overlaps
from titan_trainer.batch import BatchShape
from titan_trainer.checkpointing import CheckpointPlan
from titan_trainer.config import JobConfig
from titan_trainer.layout import Layout
from titan_trainer.model import model_spec
from titan_trainer.optimizer import optimizer_problem


def _plugin_problem(group: str, key: str, name: str) -> str | None:
    try:
        resolve(group, name)
    except PluginError as e:
        return f"{key} = {name!r}: {e}"
    return None


def find_model(config: JobConfig) -> tuple[ModelSpec | None, list[str]]:
    """(the family `[model] name` names, or None; the problems with it or its flavor): the
    run's one lookup of its model by name, before the tokenizer and the config checks, which
    are given what it found. None when the name or the flavor finds nothing."""
    name, flavor = config.model.name, config.model.flavor
    try:
        spec = model_spec(config)
    except PluginError as e:
        return None, [f"[model] name = {name!r}: {e}"]
    if flavor in spec.flavors:
        return spec, []
    known = ", ".join(spec.flavors)
    by_lower = {f.lower(): f for f in spec.flavors}
    close = [by_lower[c] for c in difflib.get_close_matches(flavor.lower(), list(by_lower), n=1)]
    hint = f"\ndid you mean {close[0]}?" if close else ""
    return None, [f"[model] flavor = {flavor!r} is not a flavor of {name}\nknown: {known}{hint}"]


def _plugin_problems(config: JobConfig, world_size: int) -> list[str]:
    """Every other plugin the config names is installed (optimizer, converters, data,
    checkpointer, metric sinks), and a seed checkpoint is made by one process."""
    plan = CheckpointPlan.of(config.checkpoint)
    named = [
        *((plugins.CONVERTERS, "[model] converters", name) for name in config.model.converters),
        (plugins.DATA, "[training] data_plugin", config.training.data_plugin),
        *((plugins.METRIC_SINKS, "[metrics] sinks", name) for name in config.metrics.sinks),
    ]
    if plan.needs_checkpointer:
        named.append(
            (plugins.CHECKPOINTERS, "[checkpoint] checkpointer", config.checkpoint.checkpointer)
        )
    found = [optimizer_problem(config.optimizer.name)]
    found += [_plugin_problem(group, where, name) for group, where, name in named]
    problems = [problem for problem in found if problem]
    if plan.seed and world_size != 1:
        problems.append(
            f"[checkpoint] create_seed_checkpoint needs exactly 1 process, but the job has {world_size}\n"
            "run it without torchrun (or with --nproc_per_node 1)"
        )
    return problems


def check_config(
    config: JobConfig,
    world_size: int,
    vocab_size: int | None = None,
    *,
    model: tuple[ModelSpec | None, list[str]] | None = None,
) -> Layout:
    """Raise ConfigError listing every problem of `config` for a job of `world_size` processes;
    else the job's `Layout` (`vocab_size`: the tokenizer's, when the caller has loaded it;
    `model`: what `find_model` found, when the caller has looked)."""
    spec, found = model if model is not None else find_model(config)
    problems = [*found, *_plugin_problems(config, world_size)]
    try:
        dims = config.parallelism.build_parallel_dims(world_size)
    except ConfigError as e:
        raise ConfigError(problems + e.problems) from None
    layout = Layout(config, dims, spec, vocab_size) if spec is not None else None
    flavor = layout.flavor if layout is not None else None
    problems += _expert_problems(config, layout)
    problems += _balance_problems(config, flavor)
    problems += _hf_export_problems(config, flavor)
    problems += _hf_snapshot_problems(config, spec)
    problems += _tensor_parallel_problems(config, layout)
    problems += _loss_chunk_problems(config, dims, flavor)
    problems += _batch_and_length_problems(config, layout.batch if layout else None, dims)
    problems += config.fault_tolerance.validate()
    problems += _context_parallel_style_problems(config, layout)
    problems += _qk_clip_problems(config, dims, layout)
    if config.model.block_causal_impl != "auto" and config.model.attn_mask_type != "block_causal":
        problems.append(
            f"[model] block_causal_impl = {config.model.block_causal_impl!r} does nothing with"
            f" attn_mask_type = {config.model.attn_mask_type!r}: it picks how a block-causal mask"
            " is computed\nset attn_mask_type = 'block_causal', or leave block_causal_impl out"
        )
    problems += _attention_backend_problems(config, dims, spec, _cp_style(config, layout))
    if config.validation.enable and dims.pp_enabled:
        problems += _pipeline_validation_problems(config)
    if problems:
        raise ConfigError(problems)
    return layout


def _qk_clip_problems(config: JobConfig, dims, layout: Layout | None) -> list[str]:
    """QK-Clip is Muon's ([optimizer.muon]), reads each head's logits over the whole
    sequence, which context parallel splits, and scales projections that no QK-norm follows.
    [metrics] max_attention_logit reads the same logits: it shares the first two limits."""
    tau = config.optimizer.muon.qk_clip_tau
    if not tau and not config.metrics.max_attention_logit:
        return []
    key = "[optimizer.muon] qk_clip_tau" if tau else "[metrics] max_attention_logit"
    off = "leave qk_clip_tau out" if tau else "set max_attention_logit = false"
    if tau and config.optimizer.name != "Muon":
        return [
            f"[optimizer.muon] qk_clip_tau = {config.optimizer.muon.qk_clip_tau} does nothing with"
            f" [optimizer] name = {config.optimizer.name!r}: it is MuonClip's\nset name = 'Muon',"
            " or leave qk_clip_tau out"
        ]
    if dims.cp_enabled:
        return [
            f"{key} needs each head's logits over the whole sequence, which"
            f" context_parallel_degree {dims.cp} splits\nset context_parallel_degree = 1, or {off}"
        ]
    model = _readable_model(config, layout)
    for module in model.modules() if model is not None else ():
        if isinstance(module, HeadAttention):
            try:
                module.qk_clip_layout()
            except NotImplementedError as e:
                return [f"{key}: {e}\n{off} for [model] name = {config.model.name!r}"]
    return []


def _context_parallel_style_problems(config: JobConfig, layout: Layout | None) -> list[str]:
    """All-to-all context parallel needs query heads per TP rank that divide by the CP degree.
    (Block-causal attention runs in both styles: the ring builds each pair of chunks' document
    mask, all-to-all the model's whole-sequence mask.)"""
    if layout is None or not layout.dims.cp_enabled:
        return []  # no model built where nothing here reads it
    if config.parallelism.context_parallel_style != "alltoall":
        return []
    model = _readable_model(config, layout)
    if model is None:
        return []
    dims = layout.dims
    why = titan_parallel.alltoall_heads_problems(model, dims.tp, dims.cp)
    return [f"[parallelism] context_parallel_style = 'alltoall': {p}" for p in why]


def _readable_model(config: JobConfig, layout: Layout | None):
    """The layout's model on the meta device, for the checks that read it; None when it cannot
    be built (an unknown model or flavor, a multi-token-prediction depth the family refuses),
    which the checks before and the preflight report."""
    if layout is None or mtp_problems(config, layout.spec):
        return None
    return layout.meta_model()


def _cp_style(config: JobConfig, layout: Layout | None) -> str:
    """The context-parallel style the run will take (the config's, when the model cannot be
    read to resolve "auto")."""
    if layout is None or not layout.dims.cp_enabled:
        return "ring"  # no context parallel: the style is never read
    if _readable_model(config, layout) is None:
        return config.parallelism.context_parallel_style
    return layout.cp_style()


def _attention_backend_problems(
    config: JobConfig, dims: ParallelDims, spec: ModelSpec | None, cp_style: str
) -> list[str]:
    """`[model] attention_backend` only steers causal attention, of a family whose models take
    a kernel (`ModelFeatures.sdpa_backend`), and context parallel's ring attention only runs
    the fused kernels."""
    backend = config.model.attention_backend
    if backend == "default":
        return []
    if config.model.attn_mask_type != "causal":
        return [
            f"[model] attention_backend = {backend!r} does nothing with attn_mask_type ="
            f" {config.model.attn_mask_type!r}: it picks the kernel of causal attention (the"
            " mask's own is block_causal_impl)\nleave attention_backend out (or 'default')"
        ]
    if backend == "math" and dims.cp > 1 and cp_style != "alltoall":
        return [
            f"[model] attention_backend = 'math' does not work with ring context parallel"
            f" (context_parallel_degree = {dims.cp}): torch's ring attention exchanges"
            " keys and values for the fused kernels only\nuse attention_backend = 'auto',"
            " 'flash', 'cudnn' or 'efficient', or context_parallel_style = 'alltoall'"
        ]
    if spec is None or spec.features.sdpa_backend:
        return []
    return [
        f"[model] attention_backend = {backend!r}: {config.model.name} {config.model.flavor}"
        " has no attention layer that takes a kernel (an `sdpa_backend` attribute, as"
        " titan-models' GroupedQueryAttention has)\nleave attention_backend out (or"
        " 'default') for this model"
    ]


def _batch_and_length_problems(
    config: JobConfig, batch: BatchShape | None, dims: ParallelDims
) -> list[str]:
    """Sequence lengths the layout can split, and a global batch accumulation can reach."""
    t = config.training
    problems = _seq_len_problems("training", t.seq_len, dims)
    batch = batch or BatchShape.of(t, dims.dp_degree)
    if not batch.divides:
        problems.append(
            f"[training] global_batch_size = {t.global_batch_size} is not a multiple of local_batch_size x data-parallel"
            f" degree = {t.local_batch_size} x {dims.dp_degree} = {batch.per_microbatch}\n"
            "gradient accumulation needs a whole number of microbatches; use a multiple, or -1"
        )
    v = config.validation
    if t.seq_len > 0 and v.enable and v.seq_len != -1:
        problems += _seq_len_problems("validation", v.seq_len, dims)
        if v.seq_len > t.seq_len or (dims.cp > 1 and v.seq_len != t.seq_len):
            problems.append(
                f"[validation] seq_len = {v.seq_len} must be {'equal to' if dims.cp > 1 else 'at most'}"
                f" [training] seq_len = {t.seq_len} (the model's positional table is that long"
                f"{'; context parallel shards it with the batch' if dims.cp > 1 else ''})\n"
                "use -1 to validate at the training sequence length"
            )
    return problems


def _pipeline_validation_problems(config: JobConfig) -> list[str]:
    """The pipeline stages exchange tensors of the training microbatch's shape, and validation
    batches run through the same stages in pieces of the training local batch."""
    t, v = config.training, config.validation
    problems = []
    if v.seq_len not in (-1, t.seq_len):
        problems.append(
            f"[validation] seq_len = {v.seq_len} must equal [training] seq_len = {t.seq_len}"
            " under pipeline parallel (the stages exchange tensors of the training shape)\n"
            "use -1 to validate at the training sequence length"
        )
    if v.local_batch_size % t.local_batch_size:
        problems.append(
            f"[validation] local_batch_size = {v.local_batch_size} must be a multiple of"
            f" [training] local_batch_size = {t.local_batch_size} under pipeline parallel"
            " (validation runs the training microbatches' shape through the stages)\n"
            f"use {t.local_batch_size} or a multiple of it"
        )
    return problems


def _expert_problems(config: JobConfig, layout: Layout | None) -> list[str]:
    """Whether the model's mixture-of-experts layers split over this layout (EP degree dividing
    the experts, TP the experts' hidden features), read from the layout's model on the meta
    device; only when EP or TP is on (a dense model under TP needs nothing here)."""
    if layout is None or (layout.dims.ep == 1 and layout.dims.tp == 1):
        return []
    dims = layout.dims
    model = _readable_model(config, layout)
    if model is None or (dims.ep == 1 and not titan_parallel.moe_layers(model)):
        return []  # a dense model under TP: nothing to split here
    problems = titan_parallel.expert_parallel_problems(model, ep=dims.ep, tp=dims.tp)
    if dims.tp > 1 and titan_parallel.moe_layers(model):
        problems += config.parallelism.expert_tp_problems(dims.tp)
    return problems


def _balance_problems(config: JobConfig, flavor: ModelArgs | None) -> list[str]:
    """The MoE balancing keys on a flavor without experts would do nothing, and some do not
    go together (Sinkhorn selection and the expert bias): say so."""
    m = config.model
    keys = m.moe_keys_set()
    if not keys or flavor is None:
        return []  # nothing set, or no flavor to check (reported as such above)
    if flavor.moe is not None:
        moe = m.experts(flavor.moe)
        if moe.router_selection == "sinkhorn" and moe.load_balance_coeff is not None:
            return [
                f"[model] moe_router_selection = 'sinkhorn' with {m.name} {m.flavor}'s expert"
                f" bias (moe_load_balance_coeff {moe.load_balance_coeff}): Sinkhorn balances"
                " every step itself\nset [model] moe_load_balance_coeff = 0 with it"
            ]
        return []
    return [
        f"[model] {keys[0]} is set but {m.name} {m.flavor} has no mixture-of-experts layers\n"
        "remove it, or pick a flavor with experts (e.g. qwen3 debugmodel_moe)"
    ]


def _hf_export_problems(config: JobConfig, flavor: ModelArgs | None) -> list[str]:
    """A router that reads a centered input has no counterpart in Hugging Face's models: the
    export at the end of the run would fail after the training, so refuse it before."""
    m = config.model
    ckpt = config.checkpoint
    if not (ckpt.last_save_in_hf or ckpt.hf_interval > 0) or flavor is None or flavor.moe is None:
        return []
    if not m.experts(flavor.moe).router_centering:
        return []
    key = "last_save_in_hf" if ckpt.last_save_in_hf else "hf_interval"
    what = "the export at the end of the run" if ckpt.last_save_in_hf else "the first snapshot"
    return [
        f"[checkpoint] {key} with {m.name} {m.flavor}'s router centering"
        " ([model] moe_router_centering): a Hugging Face router has no place for the center,"
        f" so {what} would fail\nset --model.moe_router_centering"
        f" false to train a model that exports, or leave {key} off"
    ]


def _hf_snapshot_problems(config: JobConfig, spec) -> list[str]:
    """Hugging Face snapshots (`hf_interval`) need the model's HF adapter: refused before
    training rather than at the first snapshot."""
    ckpt, m = config.checkpoint, config.model
    problems = []
    if ckpt.hf_interval > 0 and spec is not None and not spec.hf_adapter:
        problems.append(
            f"[checkpoint] hf_interval = {ckpt.hf_interval} writes Hugging Face snapshots, and"
            f" {m.name} has no Hugging Face adapter\nset hf_interval = 0, or train a model"
            " that has one (e.g. llama3)"
        )
    return problems


def _seq_len_problems(section: str, seq_len: int, dims: ParallelDims) -> list[str]:
    """Sequence parallel splits a sequence over the TP ranks, and context parallel into 2 x cp
    load-balanced chunks: the length must divide by `dims.seq_len_divisor`."""
    divisor = dims.seq_len_divisor
    if seq_len % divisor == 0:
        return []
    why = (
        f"tensor_parallel {dims.tp} x 2 x context_parallel {dims.cp} for load-balanced sequence sharding"
        if dims.cp > 1
        else f"tensor_parallel_degree {dims.tp}, for sequence parallel"
    )
    return [
        f"[{section}] seq_len = {seq_len} must divide by {divisor} ({why})\n"
        f"use a multiple of {divisor}, e.g. {(seq_len // divisor + 1) * divisor}"
    ]


def mtp_problems(config: JobConfig, spec: ModelSpec) -> list[str]:
    """`[model] n_mtp_layers` needs a family that has multi-token-prediction layers
    (`ModelFeatures.mtp`)."""
    wanted = config.model.n_mtp_layers
    if wanted is None:
        return []
    if wanted < 0:
        return [
            f"[model] n_mtp_layers = {wanted} is not valid\nuse 0 (none) or more, or leave it"
            " unset for the flavor's"
        ]
    if wanted and not spec.features.mtp:
        return [
            f"[model] n_mtp_layers = {wanted}: {config.model.name} has no multi-token-prediction"
            " layers (deepseek_v3 has)\nleave n_mtp_layers unset for this model"
        ]
    return []


def _loss_chunk_problems(
    config: JobConfig, dims: ParallelDims, flavor: ModelArgs | None
) -> list[str]:
    """`[training] loss_chunk_tokens` with what it cannot yet be combined with."""
    chunk = config.training.loss_chunk_tokens
    if chunk <= 0:
        return []
    off = "or set [training] loss_chunk_tokens = 0"
    problems = []
    if dims.tp_enabled:
        problems.append(
            f"[training] loss_chunk_tokens = {chunk} does not work with tensor parallel"
            f" (tensor_parallel_degree = {dims.tp}): the output projection is sharded over the"
            f" vocabulary there (loss parallel)\nuse tensor_parallel_degree = 1, {off}"
        )
    if dims.pp_enabled:
        problems.append(
            f"[training] loss_chunk_tokens = {chunk} does not work with pipeline parallel"
            f" (pipeline_parallel_degree = {dims.pp}): the schedule calls the loss on the last"
            f" stage's logits\nuse pipeline_parallel_degree = 1, {off}"
        )
    depth = config.model.n_mtp_layers
    if depth is None:
        depth = flavor.n_mtp_layers if flavor is not None else 0
    if depth:
        problems.append(
            f"[training] loss_chunk_tokens = {chunk} does not work with multi-token prediction"
            f" ({config.model.name} {config.model.flavor} has {depth} MTP layer"
            f"{'s' if depth > 1 else ''})\nset [model] n_mtp_layers = 0, {off}"
        )
    if config.compile.compiles("loss"):
        problems.append(
            f"[training] loss_chunk_tokens = {chunk} does not work with a compiled loss"
            ' ([compile] enable with "loss" in components): the chunked loss runs eagerly, and'
            " a compiled whole-batch loss already never writes its float32 logits\n"
            f'drop "loss" from [compile] components, {off}'
        )
    return problems


def _tensor_parallel_problems(config: JobConfig, layout: Layout | None) -> list[str]:
    """The model's tensor-parallel plan at this degree (heads, hidden sizes, experts' overlap),
    read from the layout's model on the meta device: what `parallelize` would refuse later.
    The vocabulary is padded to a multiple of 64 for any degree."""
    if layout is None or not layout.dims.tp_enabled:
        return []
    model = _readable_model(config, layout)
    if model is None or parallelizable_problems(model):
        return []  # parallelize names what the model lacks
    plan = model.tp_plan()
    problems = titan_parallel.check_tp_plan(model, plan, layout.dims.tp)
    if titan_parallel.moe_layers(model):
        problems += tp_plan_overlaps(model, plan)
    return [f"{config.model.name} {config.model.flavor}: {problem}" for problem in problems]


def block_causal_device_problem(
    config: JobConfig, device: torch.device, spec: ModelSpec
) -> str | None:
    """With block-causal attention: the model family's own check of its attention on this
    device with `[model] block_causal_impl` (`ModelSpec.block_causal_check`: the chosen
    implementation against the dense mask, forward and backward, fp32 and bf16), run
    before training; a message when it fails on any rank, so that no run trains with a mask
        that lets documents see each other. A family without a check is not checked. `spec`: the
    run's family (`Layout.spec`)."""
    if config.model.attn_mask_type != "block_causal":
        return None
    if spec.block_causal_check is None:
        return None
    start = time.perf_counter()
    problems = spec.block_causal_check(device, config.model.block_causal_impl)
    if not any_rank(bool(problems)):
        get_logger("checks").info(
            "block-causal attention matches its reference on %s (%.1f s)",
            device,
            time.perf_counter() - start,
        )
        return None
    said = "\n  ".join(problems) if problems else "(it failed on another rank; see its log)"
    return (
        f"[model] attn_mask_type = 'block_causal': {config.model.name}'s block-causal attention"
        f" (block_causal_impl = {config.model.block_causal_impl!r}) on {device_name(device)}"
        f" (torch {torch.__version__}) fails its check against the dense mask:\n  {said}\n"
        "training would let documents attend to each other, or fail; use another"
        " block_causal_impl ('dense' runs anywhere), attn_mask_type = 'causal' on this"
        " machine, or another torch version"
    )
