"""Every check a job makes before it starts, with no process group and no memory: the config
for its world size (`titan_trainer.checks`), the parallelize and pipeline configuration, the
tokenizer and the datasets (`titan_trainer.data`), and what needs the whole model on the meta
device (the pipeline split, parameter groups, attention, context parallel, the checkpoints'
disk space). The `Layout` they resolve (the `ParallelDims`, the one meta model they read) is
handed to the run (`titan_trainer.train.train`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

import titan_parallel
from titan_core import ConfigError
from titan_core.device import resolve_device_type
from titan_trainer.checkpointing.resume import resume_point, resume_problems
from titan_trainer.checkpointing.resume_groups import resume_group_problems
from titan_trainer.checkpointing.space import space_problems, store_problems
from titan_trainer.checks import check_config, find_model, mtp_problems
from titan_trainer.config import JobConfig
from titan_trainer.data import dataset_problems, tokenizer_problems
from titan_trainer.fault_tolerance import fault_tolerance_problems
from titan_trainer.layout import Layout
from titan_trainer.logs import rank_problems
from titan_trainer.param_grouping import model_names, unmatched_group_problems


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
    model = find_model(config)  # the family, found by name once for every check
    # The tokenizer first, so that the config checks read the model the run will train.
    vocab_size, tokenizer_found, tokenizer_notes = tokenizer_problems(
        config, model[0], dry_run=dry_run
    )
    try:
        layout = check_config(config, world_size, vocab_size, model=model)
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
    mtp = mtp_problems(config, layout.spec)
    if mtp:  # the checks below build the model
        return Preflight(problems + mtp, notes, vocab_size, layout)
    problems += _pipeline_problems(config, layout, notes)
    store = store_problems(config)
    if store:  # the checks below read the checkpoints there
        return Preflight(problems + store, notes, vocab_size, layout)
    problems += _param_group_problems(config, layout)
    problems += resume_problems(config, layout, shapes=not dry_run)
    problems += _attention_problems(config, layout)
    problems += _context_parallel_problems(config, layout)
    if not dry_run:
        problems += fault_tolerance_problems(config)
    space = space_problems(config, layout, notes)
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
    problems = []
    if config.validation.enable and plan.eval_problem is not None:
        problems.append(f"[validation] enable = true: {plan.eval_problem}")
    if config.eval.tasks and plan.eval_problem is not None:  # the same forward-only schedule
        problems.append(f"[eval] tasks: {plan.eval_problem}")
    return problems


def _param_group_problems(config: JobConfig, layout: Layout) -> list[str]:
    """[[optimizer.param_groups]] against the whole model (every pipeline stage's names), and
    against the groups of the checkpoint a resume loads."""
    if not config.optimizer.param_groups and resume_point(config) is None:
        return []
    return group_preflight_problems(config, layout.meta_model())


def group_preflight_problems(config: JobConfig, model: nn.Module) -> list[str]:
    """The checks that need the whole model (`model`, on the meta device, before any split):
    every group takes a parameter, and a resume finds the groups its checkpoint has."""
    problems = []
    if config.optimizer.param_groups:
        names = [name for name, _ in model_names([model])]
        problems += unmatched_group_problems(config.optimizer, names)
    return problems + resume_group_problems(config, model)


def _attention_problems(config: JobConfig, layout: Layout) -> list[str]:
    """block_causal needs a family whose forward takes `document_ids`, and a chosen
    `block_causal_impl` one that chooses it (`ModelFeatures`)."""
    if config.model.attn_mask_type != "block_causal":
        return []
    features = layout.spec.features
    kind = type(layout.meta_model()).__name__  # the class the messages name
    if not features.document_ids:
        return [
            f"[model] attn_mask_type = 'block_causal' needs a model whose forward takes"
            f" `document_ids`, and {config.model.name}'s ({kind}) does not\nuse"
            " attn_mask_type = 'causal', or add document_ids to the model (see titan-models'"
            " titan_models.attention)"
        ]
    impl = config.model.block_causal_impl
    if impl == "auto" or features.block_causal_impl:
        return []
    return [
        f"[model] block_causal_impl = {impl!r} needs a model with a `block_causal_impl`"
        f" attribute, and {config.model.name}'s ({kind}) has none\nleave"
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
