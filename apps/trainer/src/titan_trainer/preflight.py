"""Every check a job makes before it starts, with no process group and no memory: the config
for its world size (`titan_trainer.checks`), the parallelize and pipeline configuration, the
tokenizer and the datasets (`titan_trainer.data`), and what needs the whole model on the meta
device (the pipeline split, parameter groups, attention, context parallel, the checkpoints'
disk space). The `Layout` they resolve (the `ParallelDims`, the one meta model they read) is
handed to the run (`titan_trainer.train.train`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from titan_ckpt.preflight import storage_problems
from titan_core import ConfigError, plugins, resolve
from titan_core.device import resolve_device_type
from titan_trainer.checks import check_config, mtp_problems, optimizer_state_copies
from titan_trainer.config import JobConfig
from titan_trainer.data import dataset_problems, tokenizer_problems
from titan_trainer.fault_tolerance import fault_tolerance_problems
from titan_trainer.layout import Layout
from titan_trainer.logs import rank_problems
from titan_trainer.param_groups import group_preflight_problems
from titan_trainer.resume_check import resume_problems, resumed_checkpoint


@dataclass
class Preflight:
    """What the checks found, and what they resolved for the run."""

    problems: list[str]
    notes: list[str]
    vocab_size: int
    layout: Layout | None
    """None when the config itself has problems."""
    here: list[str] = field(default_factory=list)
    """A dry run's problems of this machine that a launch from here would stop for (the
    checkpoints' disk), which do not stop the simulation; in `problems` for a real run."""


def preflight(
    config: JobConfig, world_size: int, *, dry_run: bool = False, open_datasets: bool = False
) -> Preflight:
    """Every check that needs no process group and no memory. A real run stops on any problem
    before it creates process groups. A dry run checks for the job's GPUs wherever it runs,
    and takes a missing tokenizer as a note (the cluster may hold the file), using the
    flavor's vocabulary size instead. With `open_datasets` (once per job, not in a dry run)
    each dataset's first document is read too: a hub dataset out of reach stops the job here.
    """
    import titan_parallel

    # The tokenizer first, so that the config checks read the model the run will train.
    vocab_size, tokenizer_found, tokenizer_notes = tokenizer_problems(config, dry_run=dry_run)
    try:
        layout = check_config(config, world_size, vocab_size)
    except ConfigError as e:
        return Preflight(e.problems, [], 0, None)
    problems = rank_problems(config.logging, world_size)
    dims = layout.dims
    problems += titan_parallel.check_parallelize_config(
        config.parallelism,
        config.activation_checkpoint,
        config.compile,
        device_type="cuda" if dry_run else resolve_device_type(config.job.device),
        cpu_offload=config.training.enable_cpu_offload,
        dims=dims,
    )
    notes = tokenizer_notes
    problems += tokenizer_found
    problems += dataset_problems(config, notes, open_datasets=open_datasets)
    spec = resolve(plugins.MODELS, config.model.name)
    mtp = mtp_problems(config, spec)
    if mtp:  # the checks below build the model
        return Preflight(problems + mtp, notes, vocab_size, layout)
    problems += _pipeline_problems(config, layout, notes)
    store = storage_problems(config.checkpoint, config.job.dump_folder)
    if store:  # the checks below read the checkpoints there
        return Preflight(problems + store, notes, vocab_size, layout)
    problems += _param_group_problems(config, layout)
    problems += resume_problems(config, layout, shapes=not dry_run)
    problems += _attention_problems(config, layout)
    problems += _context_parallel_problems(config, layout)
    if not dry_run:
        problems += fault_tolerance_problems(config)
    space = _checkpoint_space_problems(config, layout, notes)
    if dry_run:  # the simulation goes on; the verdict says a launch from here would stop
        return Preflight(problems, notes, vocab_size, layout, here=space)
    return Preflight(problems + space, notes, vocab_size, layout)


def preflight_problems(
    config: JobConfig, world_size: int, *, dry_run: bool = False, open_datasets: bool = False
) -> tuple[list[str], list[str], int]:
    """(problems, notes, vocabulary size) of `preflight`."""
    found = preflight(config, world_size, dry_run=dry_run, open_datasets=open_datasets)
    return found.problems, found.notes, found.vocab_size


def _pipeline_problems(config: JobConfig, layout: Layout, notes: list[str]) -> list[str]:
    import titan_parallel

    p = config.parallelism
    if not layout.dims.pp_enabled:
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
    try:
        plan = titan_parallel.plan_pipeline(
            layout.meta_model(),
            layout.dims.pp,
            local_batch_size=config.training.local_batch_size,
            seq_len=config.training.seq_len,
            **p.pipeline_options(),
        )
    except ConfigError as e:
        return e.problems
    if config.validation.enable and plan.eval_problem is not None:
        return [f"[validation] enable = true: {plan.eval_problem}"]
    return []


def _param_group_problems(config: JobConfig, layout: Layout) -> list[str]:
    """[[optimizer.param_groups]] against the whole model (every pipeline stage's names), and
    against the groups of the checkpoint a resume loads."""
    if not config.optimizer.param_groups and resumed_checkpoint(config) is None:
        return []
    return group_preflight_problems(config, layout.meta_model())


def _attention_problems(config: JobConfig, layout: Layout) -> list[str]:
    """block_causal needs a model whose forward takes `document_ids`, and a chosen
    `block_causal_impl` a model that has the attribute."""
    if config.model.attn_mask_type != "block_causal":
        return []
    model = layout.meta_model()
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


def _context_parallel_problems(config: JobConfig, layout: Layout) -> list[str]:
    """A model may not take context parallel at this sequence length (Llama 4's chunked
    attention needs the sequence to fit in one chunk): its `cp_buffers()` says so."""
    if not layout.dims.cp_enabled:
        return []
    try:
        layout.meta_model().cp_buffers()
    except ValueError as e:
        return [f"[parallelism] context_parallel_degree = {layout.dims.cp}: {e}"]
    return []


def _checkpoint_space_problems(config: JobConfig, layout: Layout, notes: list[str]) -> list[str]:
    """Whether the run's checkpoints fit on the disk of their folder: the checkpointer's
    `check_space`, given the bytes of the state it saves, counted from the model's shapes on
    the meta device (parameters as built, the optimizer's copies in float32 units)."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return []
    factory = resolve(plugins.CHECKPOINTERS, ckpt.checkpointer)
    params = list(layout.meta_model().parameters())
    state_bytes = sum(p.numel() * p.element_size() for p in params) + int(
        sum(p.numel() for p in params) * 4 * optimizer_state_copies(config.optimizer)
    )
    problems, note = factory.check_space(
        ckpt, config.job.dump_folder, state_bytes, config.training.steps
    )
    if note:
        notes.append(note)
    return problems
