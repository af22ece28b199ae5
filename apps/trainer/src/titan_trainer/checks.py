"""Checks that need more than one section, or the job's size: run before any process group
exists, so a bad combination costs seconds, not a queue slot."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import time

import torch

from titan_core import ConfigError, ParallelDims, PluginError, plugins, resolve
from titan_core.device import resolve_device_type
from titan_trainer.config import JobConfig
from titan_trainer.fault_tolerance import fault_tolerance_problems
from titan_trainer.logs import rank_problems
from titan_trainer.optimizer import optimizer_factory, optimizer_problem
from titan_trainer.param_groups import group_preflight_problems, resumed_checkpoint


def _plugin_problem(group: str, key: str, name: str) -> str | None:
    try:
        resolve(group, name)
    except PluginError as e:
        return f"{key} = {name!r}: {e}"
    return None


def parallel_dims_for(config: JobConfig, world_size: int) -> ParallelDims:
    """The layout `[parallelism]` describes for a job of `world_size` processes (raises
    ConfigError when the degrees do not fit it)."""
    return config.parallelism.build_parallel_dims(world_size)


def check_config(config: JobConfig, world_size: int) -> None:
    """Raise ConfigError listing every problem of `config` for a job of `world_size` processes."""
    problems: list[str] = []
    model_problem = _plugin_problem(plugins.MODELS, "[model] name", config.model.name)
    if model_problem:
        problems.append(model_problem)
    else:
        spec = resolve(plugins.MODELS, config.model.name)
        if config.model.flavor not in spec.flavors:
            known = ", ".join(spec.flavors)
            by_lower = {name.lower(): name for name in spec.flavors}
            close = [
                by_lower[c]
                for c in difflib.get_close_matches(config.model.flavor.lower(), list(by_lower), n=1)
            ]
            hint = f"\ndid you mean {close[0]}?" if close else ""
            problems.append(
                f"[model] flavor = {config.model.flavor!r} is not a flavor of {config.model.name}\nknown: {known}{hint}"
            )
    problem = optimizer_problem(config.optimizer.name)
    if problem:
        problems.append(problem)
    for name in config.model.converters:
        problem = _plugin_problem(plugins.CONVERTERS, "[model] converters", name)
        if problem:
            problems.append(problem)
    problem = _plugin_problem(plugins.DATA, "[training] data_plugin", config.training.data_plugin)
    if problem:
        problems.append(problem)
    ckpt = config.checkpoint
    if ckpt.enable or ckpt.create_seed_checkpoint or ckpt.initial_load_path:
        problem = _plugin_problem(
            plugins.CHECKPOINTERS, "[checkpoint] checkpointer", ckpt.checkpointer
        )
        if problem:
            problems.append(problem)
    if ckpt.create_seed_checkpoint and world_size != 1:
        problems.append(
            f"[checkpoint] create_seed_checkpoint needs exactly 1 process, but the job has {world_size}\n"
            "run it without torchrun (or with --nproc_per_node 1)"
        )

    try:
        dims = parallel_dims_for(config, world_size)
    except ConfigError as e:
        problems.extend(e.problems)
        raise ConfigError(problems) from None
    problems += _expert_problems(config, dims)
    problems += _balance_problems(config)
    problems += _tensor_parallel_problems(config, dims)
    if not model_problem:
        problems += _loss_chunk_problems(config, dims, spec)
    t = config.training
    problems += _seq_len_problems("training", t.seq_len, dims)
    per_step = t.local_batch_size * dims.dp_degree
    if t.global_batch_size != -1 and t.global_batch_size % per_step:
        problems.append(
            f"[training] global_batch_size = {t.global_batch_size} is not a multiple of local_batch_size x data-parallel"
            f" degree = {t.local_batch_size} x {dims.dp_degree} = {per_step}\n"
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
    problems += config.fault_tolerance.validate()
    if config.model.attn_mask_type == "block_causal" and dims.cp > 1:
        problems.append(
            f"[model] attn_mask_type = 'block_causal' does not work with context parallel"
            f" (context_parallel_degree = {dims.cp}): torch's context-parallel attention takes"
            " no mask, so documents would see each other across the shards (no"
            " block_causal_impl carries document boundaries across them: dense and flex masks"
            " and varlen offsets all cover the whole sequence)\nuse attn_mask_type = 'causal'"
            " with context parallel, or context_parallel_degree = 1"
        )
    if config.model.block_causal_impl != "auto" and config.model.attn_mask_type != "block_causal":
        problems.append(
            f"[model] block_causal_impl = {config.model.block_causal_impl!r} does nothing with"
            f" attn_mask_type = {config.model.attn_mask_type!r}: it picks how a block-causal mask"
            " is computed\nset attn_mask_type = 'block_causal', or leave block_causal_impl out"
        )
    if config.validation.enable and dims.pp_enabled:
        problems += _pipeline_validation_problems(config)
    if problems:
        raise ConfigError(problems)


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


def _expert_problems(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Whether the model's mixture-of-experts layers split over this layout (EP degree dividing
    the experts, TP the experts' hidden features), read from the model built on the meta
    device; only when EP or TP is on (a dense model under TP needs nothing here)."""
    import titan_parallel

    if dims.ep == 1 and dims.tp == 1:
        return []
    try:
        spec = resolve(plugins.MODELS, config.model.name)
        args = spec.flavors[config.model.flavor]
    except (PluginError, KeyError):
        return []  # reported as such by the checks above
    if dims.ep == 1 and getattr(args, "moe", None) is None:
        return []  # a dense flavor under TP: nothing to split here
    with torch.device("meta"):
        model = spec.build(args)
    problems = titan_parallel.expert_parallel_problems(model, ep=dims.ep, tp=dims.tp)
    if dims.tp > 1 and titan_parallel.moe_layers(model):
        problems += config.parallelism.expert_tp_problems()
    return problems


def _balance_problems(config: JobConfig) -> list[str]:
    """The MoE balancing keys on a flavor without experts would do nothing: say so."""
    m = config.model
    keys = [
        k for k in ("moe_aux_loss_alpha", "moe_load_balance_coeff") if getattr(m, k) is not None
    ]
    if not keys:
        return []
    try:
        args = resolve(plugins.MODELS, m.name).flavors[m.flavor]
    except (PluginError, KeyError):
        return []  # reported as such by the checks above
    if getattr(args, "moe", None) is not None:
        return []
    return [
        f"[model] {keys[0]} is set but {m.name} {m.flavor} has no mixture-of-experts layers\n"
        "remove it, or pick a flavor with experts (e.g. qwen3 debugmodel_moe)"
    ]


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


def hf_import_vocab(config: JobConfig) -> int | None:
    """The vocabulary size of the Hugging Face weights a run starts from (`vocab_size` in the
    config.json of `initial_load_path` with `initial_load_in_hf`), or None."""
    ckpt = config.checkpoint
    if not (ckpt.initial_load_in_hf and ckpt.initial_load_path):
        return None
    try:
        with open(os.path.join(ckpt.initial_load_path, "config.json"), encoding="utf-8") as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError, AttributeError):  # no readable config.json: the tokenizer's
        return None
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def model_args_for(spec, config: JobConfig, vocab_size: int):
    """The flavor's arguments with the tokenizer's vocabulary (rounded up to a multiple of 64,
    so that any TP degree up to 64 splits it evenly, or the vocabulary of the Hugging Face
    weights the run starts from when that holds the tokenizer's: Qwen's 151,936 rows for its
    151,669 ids) and the training sequence length."""
    args = spec.flavors[config.model.flavor]
    padded = -(-vocab_size // 64) * 64
    imported = hf_import_vocab(config)
    if imported is not None and imported >= vocab_size:
        padded = imported
    changes = {}
    fields = {f.name for f in dataclasses.fields(args)}
    if "vocab_size" in fields:
        changes["vocab_size"] = padded
    if "max_seq_len" in fields:
        changes["max_seq_len"] = config.training.seq_len
    if getattr(args, "moe", None) is not None:
        changes["moe"] = moe_balance_for(args.moe, config)
    if config.model.n_mtp_layers is not None and "n_mtp_layers" in fields:
        changes["n_mtp_layers"] = config.model.n_mtp_layers
    return dataclasses.replace(args, **changes)


def moe_balance_for(moe, config: JobConfig):
    """The flavor's MoE arguments with the balancing the [model] keys set (0: off)."""
    m = config.model
    changes = {}
    if m.moe_aux_loss_alpha is not None:
        changes["aux_loss_alpha"] = m.moe_aux_loss_alpha
    if m.moe_load_balance_coeff is not None:
        changes["load_balance_coeff"] = m.moe_load_balance_coeff or None
    return dataclasses.replace(moe, **changes)


def _mtp_problems(config: JobConfig, spec) -> list[str]:
    """`[model] n_mtp_layers` needs a family that has multi-token-prediction layers."""
    wanted = config.model.n_mtp_layers
    if wanted is None:
        return []
    if wanted < 0:
        return [
            f"[model] n_mtp_layers = {wanted} is not valid\nuse 0 (none) or more, or leave it"
            " unset for the flavor's"
        ]
    args = spec.flavors[config.model.flavor]
    if wanted and not any(f.name == "n_mtp_layers" for f in dataclasses.fields(args)):
        return [
            f"[model] n_mtp_layers = {wanted}: {config.model.name} has no multi-token-prediction"
            " layers (deepseek_v3 has)\nleave n_mtp_layers unset for this model"
        ]
    return []


def _loss_chunk_problems(config: JobConfig, dims: ParallelDims, spec) -> list[str]:
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
    flavor = spec.flavors.get(config.model.flavor)
    depth = config.model.n_mtp_layers
    if depth is None:
        depth = getattr(flavor, "n_mtp_layers", 0)
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


def preflight_problems(
    config: JobConfig, world_size: int, *, dry_run: bool = False, open_datasets: bool = False
) -> tuple[list[str], list[str], int]:
    """Every check that needs no process group and no memory: the config for this world size,
    the parallelize and pipeline configuration, the tokenizer and the datasets.

    Returns (problems, notes, vocabulary size). A real run stops on any problem before it
    creates process groups. A dry run checks for the job's GPUs wherever it runs, and takes
    a missing tokenizer as a note (the cluster may hold the file), using the flavor's
    vocabulary size instead. With `open_datasets` (once per job, not in a dry run) each
    dataset's first document is read too: a hub dataset out of reach stops the job here.
    """
    import titan_parallel

    problems: list[str] = []
    notes: list[str] = []
    try:
        check_config(config, world_size)
    except ConfigError as e:
        return e.problems, notes, 0
    problems += rank_problems(config.logging, world_size)
    dims = parallel_dims_for(config, world_size)
    device_type = "cuda" if dry_run else resolve_device_type(config.job.device)
    problems += titan_parallel.check_parallelize_config(
        config.parallelism,
        config.activation_checkpoint,
        config.compile,
        device_type=device_type,
        cpu_offload=config.training.enable_cpu_offload,
        dims=dims,
    )
    spec = resolve(plugins.MODELS, config.model.name)
    data = resolve(plugins.DATA, config.training.data_plugin)
    vocab_size = getattr(spec.flavors[config.model.flavor], "vocab_size", 0)
    tokenizer_path, note = config.model.tokenizer_source()
    if note:
        notes.append(note)
    try:
        vocab_size = data.build_tokenizer(tokenizer_path).vocab_size
    except Exception as e:  # any failure to load is the user's to see, with its reason
        key = (
            "tokenizer_path" if tokenizer_path == config.model.tokenizer_path else "hf_assets_path"
        )
        message = f"[model] {key} = {tokenizer_path!r} cannot be loaded: {_first_line(e)}"
        if dry_run:
            notes.append(f"{message}; memory uses the flavor's vocabulary ({vocab_size:,})")
        else:
            problems.append(
                message + f"\npoint {key} at a tokenizer.json or tokenizer.model (or a"
                " folder holding one), or use byte"
            )
    else:
        problems += _hf_vocab_problems(config, tokenizer_path, vocab_size, notes)
    datasets = [("training", config.training.dataset, config.training.dataset_path)]
    if config.validation.enable:
        datasets.append(("validation", config.validation.dataset, config.validation.dataset_path))
    for section, dataset, path in datasets:
        found = _dataset_problems(data, section, dataset, path, notes)
        if not found and open_datasets:
            found = _dataset_open_problems(data, section, dataset, path)
        problems += found
    mtp = _mtp_problems(config, spec)
    if mtp:  # the checks below build the model
        return problems + mtp, notes, vocab_size
    problems += _pipeline_problems(config, spec, dims, vocab_size, notes)
    problems += _param_group_problems(config, spec, vocab_size)
    problems += _attention_problems(config, spec, vocab_size)
    problems += _context_parallel_problems(config, spec, dims, vocab_size)
    if not dry_run:
        problems += fault_tolerance_problems(config)
    space = _checkpoint_space_problems(config, spec, vocab_size, notes)
    if not dry_run:  # a dry run plans for the cluster's disks, not this machine's
        problems += space
    return problems, notes, vocab_size


def _hf_vocab_problems(
    config: JobConfig, tokenizer_path: str, vocab_size: int, notes: list[str]
) -> list[str]:
    """Hugging Face weights to start from must have a row for every id of the tokenizer."""
    imported = hf_import_vocab(config)
    if imported is None:
        return []
    path = config.checkpoint.initial_load_path
    if imported < vocab_size:
        return [
            f"[checkpoint] initial_load_path = {path!r} holds weights for {imported:,} token ids"
            f" (its config.json), fewer than the {vocab_size:,} of the tokenizer"
            f" {tokenizer_path!r}\nuse the tokenizer those weights were trained"
            f" with (a Hugging Face folder holds it: --model.tokenizer_path {path})"
        ]
    notes.append(
        f"model: vocabulary {imported:,} from the Hugging Face weights in {path}"
        f" (the tokenizer has {vocab_size:,} ids)"
    )
    return []


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _dataset_problems(
    data, section: str, dataset: str, path: str | None, notes: list[str]
) -> list[str]:
    describe = getattr(data, "describe_dataset", None)
    if describe is None:
        notes.append(
            f"data plugin {data.name!r} cannot check [{section}] dataset before loading it"
        )
        return []
    try:
        notes.append(f"[{section}] dataset: {describe(dataset, path)}")
    except (ValueError, FileNotFoundError, OSError) as e:
        return [f"[{section}] dataset = {dataset!r}: {_first_line(e)}"]
    return []


def _dataset_open_problems(data, section: str, dataset: str, path: str | None) -> list[str]:
    """The data plugin reads the dataset's first document (see `DataSpec.check_dataset`)."""
    check = getattr(data, "check_dataset", None)
    if check is None:
        return []
    try:
        check(dataset, path)
    except Exception as e:  # noqa: BLE001 - whatever a plugin raises, its message is the answer
        if callable(getattr(e, "for_option", None)):
            # A first row without the default text field: reachable, and the loader checks the
            # field with the run's dataset_text_field, naming that key (guards.py).
            return []
        text = str(e).strip() or type(e).__name__
        named = text.startswith(f"dataset {dataset} ")  # titan-data's messages name it
        return [f"[{section}] {text}" if named else f"[{section}] dataset = {dataset!r}: {text}"]
    return []


def _tensor_parallel_problems(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The model's tensor-parallel plan at this degree (heads, hidden sizes, experts' overlap),
    read from the model built on the meta device: what `parallelize` would refuse later. The
    vocabulary is padded to a multiple of 64 for any degree, so the flavor's own serves."""
    import titan_parallel

    if not dims.tp_enabled:
        return []
    try:
        spec = resolve(plugins.MODELS, config.model.name)
        args = spec.flavors[config.model.flavor]
    except (PluginError, KeyError):
        return []  # reported as such by the checks above
    with torch.device("meta"):
        model = spec.build(args)
    if not hasattr(model, "tp_plan"):
        return []  # parallelize names what the model lacks
    from titan_parallel.expert_parallel import tp_plan_overlaps

    plan = model.tp_plan()
    problems = titan_parallel.check_tp_plan(model, plan, dims.tp)
    if titan_parallel.moe_layers(model):
        problems += tp_plan_overlaps(model, plan)
    return [f"{config.model.name} {config.model.flavor}: {problem}" for problem in problems]


def _pipeline_problems(
    config: JobConfig, spec, dims: ParallelDims, vocab_size: int, notes
) -> list[str]:
    import titan_parallel

    p = config.parallelism
    if not dims.pp_enabled:
        default = type(p)().pipeline_parallel_schedule
        try:
            name = titan_parallel.schedule_name(p.pipeline_parallel_schedule)
        except ConfigError as e:
            return e.problems
        if name != default or p.pipeline_parallel_schedule_csv:
            notes.append(
                f"[parallelism] pipeline_parallel_schedule = {name} has no effect: pipeline_parallel_degree is 1"
            )
        return []
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    try:
        plan = titan_parallel.plan_pipeline(
            model,
            dims.pp,
            schedule=p.pipeline_parallel_schedule,
            microbatch_size=p.pipeline_parallel_microbatch_size,
            local_batch_size=config.training.local_batch_size,
            layers_per_stage=p.pipeline_parallel_layers_per_stage,
            first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
            last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
            split_points=p.module_fqns_per_model_part,
            seq_len=config.training.seq_len,
            csv_path=p.pipeline_parallel_schedule_csv or None,
        )
    except ConfigError as e:
        return e.problems
    if config.validation.enable and plan.eval_problem is not None:
        return [f"[validation] enable = true: {plan.eval_problem}"]
    return []


def _param_group_problems(config: JobConfig, spec, vocab_size: int) -> list[str]:
    """[[optimizer.param_groups]] against the whole model (every pipeline stage's names), and
    against the groups of the checkpoint a resume loads."""
    if not config.optimizer.param_groups and resumed_checkpoint(config) is None:
        return []
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    return group_preflight_problems(config, model)


def _attention_problems(config: JobConfig, spec, vocab_size: int) -> list[str]:
    """block_causal needs a model whose forward takes `document_ids`."""
    if config.model.attn_mask_type != "block_causal":
        return []
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    if "document_ids" not in inspect.signature(model.forward).parameters:
        return [
            f"[model] attn_mask_type = 'block_causal' needs a model whose forward takes"
            f" `document_ids`, and {config.model.name}'s ({type(model).__name__}) does not\nuse"
            " attn_mask_type = 'causal', or add document_ids to the model (see titan-models'"
            " titan_models.attention)"
        ]
    impl = config.model.block_causal_impl
    if impl == "auto" or hasattr(model, "block_causal_impl"):
        return []
    return [
        f"[model] block_causal_impl = {impl!r} needs a model with a `block_causal_impl`"
        f" attribute, and {config.model.name}'s ({type(model).__name__}) has none\nleave"
        " block_causal_impl = 'auto' (the model's own choice), or add the attribute (see"
        " titan-models' titan_models.block_causal)"
    ]


def block_causal_device_problem(config: JobConfig, device: torch.device) -> str | None:
    """With block-causal attention: the model family's own check of its attention on this
    device with `[model] block_causal_impl` (`ModelSpec.block_causal_check`: the chosen
    implementation against the dense mask, forward and backward, fp32 and bf16), run
    before training; a message when it fails on any rank, so that no run trains with a mask
    that lets documents see each other. A family without a check is not checked."""
    if config.model.attn_mask_type != "block_causal":
        return None
    from titan_core import any_rank, device_name, get_logger

    spec = resolve(plugins.MODELS, config.model.name)
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


def _context_parallel_problems(config: JobConfig, spec, dims: ParallelDims, vocab_size: int):
    """A model may not take context parallel at this sequence length (Llama 4's chunked
    attention needs the sequence to fit in one chunk): its `cp_buffers()` says so."""
    if not dims.cp_enabled:
        return []
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    try:
        model.cp_buffers()
    except ValueError as e:
        return [f"[parallelism] context_parallel_degree = {dims.cp}: {e}"]
    return []


def _checkpoint_space_problems(config: JobConfig, spec, vocab_size: int, notes) -> list[str]:
    """Whether the run's checkpoints fit on the disk of their folder: the checkpointer's
    `check_space`, given the bytes of the state it saves, counted from the model's shapes on
    the meta device (parameters as built, the optimizer's copies in float32 units)."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return []
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    with torch.device("meta"):
        model = spec.build(model_args_for(spec, config, vocab_size))
    params = list(model.parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params) + int(
        sum(p.numel() for p in params) * 4 * optimizer_state_copies(config.optimizer)
    )
    problems, note = factory.check_space(
        ckpt, config.job.dump_folder, state_bytes, config.training.steps
    )
    if note:
        notes.append(note)
    return problems


def optimizer_state_copies(optimizer) -> float:
    """Parameter-sized copies the optimizer of an [optimizer] section keeps, in units of the
    (float32) parameters' bytes, as the optimizer's factory reports them
    (`titan_core.OptimizerFactory.state_copies`)."""
    return optimizer_factory(optimizer.name).state_copies(optimizer)
