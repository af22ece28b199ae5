"""Pipeline parallel: stages, schedules, and the loss and gradient norm across stages.

`build_pipeline` splits a model that declares its blocks (see `pipeline_split`) into the
stages this pipeline rank owns, wraps them in `torch.distributed.pipelining.PipelineStage`s
and builds the schedule named in `SCHEDULES` (or one read from a CSV file). The caller then
parallelises (TP, FSDP, ...) and initialises each `Pipeline.model_parts` entry in place, and
runs a training step with `Pipeline.step(inputs, labels)`.

Gradients: the loss on the last stage is divided by the number of microbatches, so the
gradients summed over microbatches equal those of the mean loss over the whole local batch.
`Pipeline.eval` runs the schedule forward only (validation) and returns the sum of the
microbatches' losses as the loss function gives them, undivided.
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.tensor import DTensor

from titan_core.compat import accepts, note_missing
from titan_core.config import ConfigError
from titan_parallel.pipeline_split import (
    build_stage_modules,
    split_balanced,
    split_by_layers,
    validate_split_points,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelinePlan",
    "StageIO",
    "infer_stage_io",
    "broadcast_pipeline_loss",
    "build_pipeline",
    "pipeline_stage_ids",
    "plan_pipeline",
    "schedule_name",
    "pp_total_norm",
]

StageStyle = Literal["single", "loop", "v"]

SCHEDULES: dict[str, StageStyle] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
"""Schedule name -> how stages sit on ranks: one per rank ("single"), several per rank in
round-robin order ("loop": rank r holds stages r, r+pp, ...) or two per rank in a V ("v":
rank r holds stages r and 2*pp-1-r). Classes come from torch's `get_schedule_class`."""

_ROUND_BASED = ("Interleaved1F1B", "InterleavedZeroBubble")


@dataclass
class Pipeline:
    """What `build_pipeline` returns for this rank."""

    schedule: _PipelineSchedule
    stages: list[PipelineStage]
    model_parts: list[nn.Module]
    """This rank's stage modules, in stage order; parallelise and initialise them in place."""
    stage_ids: list[int]
    num_stages: int
    n_microbatches: int
    has_first: bool
    """This rank runs the first stage: it feeds the input tokens."""
    has_last: bool
    """This rank runs the last stage: it computes the loss."""
    loss: _MicrobatchLoss | None = None
    """The schedule's loss function (divides by the microbatches in training, not in eval)."""
    eval_problem: str | None = None
    """Why `eval` cannot run on this layout (see `PipelinePlan.eval_problem`), or None."""

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward and backward over all microbatches of one local batch.

        Returns the mean loss over the local batch on a rank with the last stage and None
        elsewhere (see `broadcast_pipeline_loss`). Gradients accumulate into the parameters.
        `kwargs` (batch-sized tensors, e.g. `document_ids`) are cut into microbatches like the
        inputs and given to every stage's forward.
        """
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (inputs,) if self.has_first else ()
        self.schedule.step(
            *args,
            target=labels if self.has_last else None,
            losses=losses,
            return_outputs=False,
            **kwargs,
        )
        if losses is None:
            return None
        # Each microbatch loss was already divided by n_microbatches (see _MicrobatchLoss).
        # Under loss parallel (TP) each loss is a replicated DTensor: sum plain tensors.
        return torch.stack(
            [
                (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
                for loss in losses
            ]
        ).sum()

    @torch.no_grad()
    def eval(
        self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward only over all microbatches of one batch, the same size as a training
        step's local batch (the stages exchange tensors of the training microbatch's shape).

        Returns, on a rank with the last stage, the sum over microbatches of the loss function
        as it is (a loss function that returns a sum over tokens gives the batch's sum), and
        None elsewhere (see `broadcast_pipeline_loss`)."""
        if self.eval_problem is not None:  # every rank knows it: none starts a collective
            raise ConfigError([self.eval_problem])
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        args = (inputs,) if self.has_first else ()
        if self.loss is not None:
            self.loss.divide = False
        try:
            self.schedule.eval(
                *args, target=labels if self.has_last else None, losses=losses, **kwargs
            )
        finally:
            if self.loss is not None:
                self.loss.divide = True
        # Without a backward, FSDP modules built with reshard_after_forward=False stay
        # unsharded after their forward (whole parameters in place of the sharded ones the
        # optimizer and the gradients hold): shard them again, as a training step ends.
        for part in self.model_parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        if losses is None:
            return None
        return torch.stack(
            [
                (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().float()
                for loss in losses
            ]
        ).sum()


@dataclass(frozen=True)
class StageIO:
    """What flows between pipeline stages for one microbatch, as tensors whose values do not
    matter (meta or fake). Given to `build_pipeline`, it replaces the shape exchange the
    stages otherwise do at their first step, which a fake process group (the dry run) cannot
    carry."""

    first_input: torch.Tensor
    """The first stage's input (token ids)."""
    hidden: torch.Tensor
    """What every stage but the last passes on, and every stage but the first receives."""
    last_output: torch.Tensor | tuple[torch.Tensor, ...]
    """The last stage's output (logits, or a tuple such as a multi-token-prediction model's
    logits of every depth; DTensors under loss parallel)."""


@torch.no_grad()
def infer_stage_io(probe: nn.Module, first_input: torch.Tensor) -> StageIO:
    """Run `probe` once on `first_input` as the whole model (what the last stage returns), and
    once as a first stage, its `post_blocks` modules taken out (what a stage passes on: the
    hidden states, or whatever the model hands over, such as a multi-token-prediction model's
    embeddings of the tokens ahead). `probe` is the model with the same parallelisms (TP,
    FSDP, mixed precision) as the stages, usually trimmed to one block (and the blocks its
    `post_blocks` name), materialised on fake tensors (or for real); `first_input` is one
    microbatch as the first stage sees it (after context-parallel sharding, when that is on)."""
    output = probe(first_input)
    with _as_first_stage(probe):
        hidden = probe(first_input)
    # Recorded without autograd; in training both carry gradients between stages.
    return StageIO(
        first_input=first_input, hidden=_grad_leaves(hidden), last_output=_grad_leaves(output)
    )


@contextlib.contextmanager
def _as_first_stage(model: nn.Module):
    """`model` without its post-block modules (None, or deleted from `layers`), as
    `build_stage_modules` leaves a stage that does not end the model; restored after."""
    taken: list[tuple[nn.Module, str, nn.Module]] = []
    for name in model.post_blocks:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, leaf, None)
        if module is None:
            continue
        taken.append((parent, leaf, module))
        if isinstance(parent, nn.ModuleDict):
            del parent[leaf]
        else:
            setattr(parent, leaf, None)
    try:
        yield
    finally:
        for parent, leaf, module in reversed(taken):
            if isinstance(parent, nn.ModuleDict):
                parent[leaf] = module
            else:
                setattr(parent, leaf, module)


def _grad_leaves(out):
    if isinstance(out, tuple):
        return tuple(t.detach().requires_grad_(True) for t in out)
    return out.detach().requires_grad_(True)


def _stage_kwargs(io: StageIO | None, stage_id: int, num_stages: int) -> dict:
    if io is None:
        return {}
    first, last = stage_id == 0, stage_id == num_stages - 1
    kwargs = dict(
        input_args=io.first_input if first else io.hidden,
        output_args=io.last_output if last else io.hidden,
    )
    if not accepts(PipelineStage.__init__, "output_grads"):
        note_missing(
            "PipelineStage(input_grads=, output_grads=)",
            "pipeline stages take their gradients' shapes from their inputs and outputs",
        )
        return kwargs
    return dict(
        kwargs,
        input_grads=None if first else io.hidden,
        # The last stage's output gradient comes from its own loss, never from a peer; torch
        # still wants its shape when the output is a DTensor (loss parallel).
        output_grads=io.last_output if last else io.hidden,
    )


def _skip_warmup_with_itself(stage: PipelineStage, pp_rank: int) -> None:
    """torch 2.11's schedules open the links between stages with a send and a receive to each
    neighbouring stage, even one on the same rank (the V schedules, ZBVZeroBubble and
    DualPipeV, keep two neighbouring stages on one rank); gloo cannot send to itself ("Pair is
    not connected"), and neighbours on one rank exchange nothing through the group anyway.
    Newer torch has no such warm-up; where it does, only the ops with other ranks are kept."""
    warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warmup is None:
        return

    def with_other_ranks() -> list:
        return [op for op in warmup() if op.group_peer != pp_rank]

    stage._get_init_p2p_neighbors_ops = with_other_ranks


def pipeline_stage_ids(
    style: StageStyle, pp_rank: int, pp_degree: int, stages_per_rank: int
) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in increasing order."""
    if style == "single":
        return [pp_rank]
    if style == "loop":
        return [pp_rank + k * pp_degree for k in range(stages_per_rank)]
    if style == "v":
        return sorted([pp_rank, 2 * pp_degree - 1 - pp_rank])
    raise ValueError(f"unknown stage style {style!r}")


def _csv_stage_ids(csv_path: Path, pp_degree: int) -> tuple[list[list[int]], bool]:
    """Stage indices per rank in a schedule CSV, and whether it holds communication actions."""
    if not csv_path.is_file():
        raise ConfigError(
            f"[parallelism] pipeline_parallel_schedule_csv = {csv_path} does not exist"
        )
    with open(csv_path, newline="") as f:
        rows = [[_Action.from_str(cell) for cell in row] for row in csv.reader(f)]
    if len(rows) != pp_degree:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_schedule_csv = {csv_path} has {len(rows)} rows"
            f" but pipeline_parallel_degree is {pp_degree}\nthe CSV needs one row per pipeline rank"
        )
    per_rank, has_comms = [], False
    for row in rows:
        ids = set()
        for action in row:
            if action is None:
                continue
            if action.is_compute_op and action.stage_index >= 0:
                ids.add(action.stage_index)
            elif not action.is_compute_op:
                has_comms = True
            for sub in action.sub_actions or ():
                ids.add(sub.stage_index)
        per_rank.append(sorted(ids))
    return per_rank, has_comms


def _check_microbatches(
    schedule: str, n_microbatches: int, num_stages: int, pp_degree: int
) -> None:
    problems = []
    style = SCHEDULES[schedule]
    if style == "single" and num_stages != pp_degree:
        problems.append(
            f"[parallelism] pipeline_parallel_schedule = {schedule} runs one stage per rank, but the split"
            f" has {num_stages} stages for pipeline_parallel_degree {pp_degree}\n"
            "use a multi-stage schedule (Interleaved1F1B, ...) or split into pp stages"
        )
    if style == "loop" and num_stages % pp_degree:
        problems.append(
            f"[parallelism] {schedule} places stages round-robin on ranks, so the number of stages"
            f" ({num_stages}) must be a multiple of pipeline_parallel_degree ({pp_degree})"
        )
    if style == "v" and num_stages != 2 * pp_degree:
        problems.append(
            f"[parallelism] pipeline_parallel_schedule = {schedule} needs exactly 2 stages per rank in a V"
            f" ({2 * pp_degree} stages for pipeline_parallel_degree {pp_degree}), got {num_stages}\n"
            "set pipeline_parallel_layers_per_stage so that the model splits into 2 x pp stages"
        )
    if schedule == "1F1B" and n_microbatches < num_stages:
        problems.append(
            f"[parallelism] 1F1B needs at least as many microbatches as stages: {n_microbatches} < {num_stages}\n"
            "lower pipeline_parallel_microbatch_size or raise training.local_batch_size"
        )
    if style == "v" and n_microbatches < num_stages:
        problems.append(
            f"[parallelism] {schedule} needs at least as many microbatches as stages:"
            f" {n_microbatches} < {num_stages}\n"
            "lower pipeline_parallel_microbatch_size or raise training.local_batch_size"
        )
    if schedule in _ROUND_BASED:
        rounds = max(1, n_microbatches // pp_degree)
        if n_microbatches % rounds:
            problems.append(
                f"[parallelism] {schedule} runs microbatches in rounds of about pipeline_parallel_degree"
                f" ({pp_degree}): {n_microbatches} microbatches do not split into {rounds} equal rounds\n"
                f"use a number of microbatches below {pp_degree} or a multiple of it"
            )
    if problems:
        raise ConfigError(problems)


class _MicrobatchLoss:
    """`loss_fn` divided by the number of microbatches (training: the gradients summed over
    microbatches are those of the mean loss), or as it is (`divide` False: `Pipeline.eval`)."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], n_microbatches: int):
        self.loss_fn, self.n_microbatches, self.divide = loss_fn, n_microbatches, True

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(output, target)
        return loss / self.n_microbatches if self.divide else loss


@dataclass(frozen=True)
class PipelinePlan:
    """How a model splits into stages and which stages each pipeline rank runs."""

    schedule: str
    """The schedule's name ("custom CSV" for a CSV schedule)."""
    names_per_stage: list[list[str]]
    stage_ids_per_rank: list[list[int]]
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.names_per_stage)

    @property
    def eval_problem(self) -> str | None:
        """Why a forward-only pass cannot run on this layout, or None. Where one rank holds two
        neighbouring stages (the V schedules, ZBVZeroBubble and DualPipeV, and a CSV schedule
        that places stages so), torch's forward-only schedule (2.15) still runs the backward
        hand-off between them and fails ("can't steal_bwd_input if this stage doesn't have
        backward")."""
        for rank, ids in enumerate(self.stage_ids_per_rank):
            pair = next((s for s in ids if s + 1 in ids), None)
            if pair is not None:
                return (
                    f"a forward-only pass (validation) does not run under the {self.schedule}"
                    f" pipeline schedule: pipeline rank {rank} holds the neighbouring stages"
                    f" {pair} and {pair + 1}, whose hand-off torch's forward-only schedule runs"
                    " as in training and fails\nuse a schedule that keeps neighbouring stages"
                    " on different ranks (1F1B, Interleaved1F1B, InterleavedZeroBubble, ...)"
                    " or turn validation off"
                )
        return None


def plan_pipeline(
    model: nn.Module,
    pp_degree: int,
    *,
    schedule: str = "1F1B",
    microbatch_size: int,
    local_batch_size: int,
    layers_per_stage: int | None = None,
    stages_per_rank: int | None = None,
    first_stage_less_layers: int = 1,
    last_stage_less_layers: int = 1,
    split_points: Sequence[Sequence[str]] | None = None,
    balance: Literal["layers", "params", "flops"] = "layers",
    seq_len: int | None = None,
    csv_path: str | Path | None = None,
) -> PipelinePlan:
    """Split and schedule checks without any process group: raises `ConfigError` naming what
    cannot work. A trainer calls it before creating process groups; `build_pipeline` calls it
    too, with the same keywords.

    Args:
        schedule: a name from `SCHEDULES` (case-insensitive); ignored when `csv_path` is set.
        microbatch_size, local_batch_size: the local batch is cut into
            `local_batch_size // microbatch_size` microbatches.
        layers_per_stage: units (layers, with the embedding and output counted as
            `first_stage_less_layers` / `last_stage_less_layers` layers) per stage; fixes the
            number of stages. Otherwise the count is pp x `stages_per_rank` (default 1 for
            single-stage schedules, 2 for the others).
        split_points: explicit module names per stage, overriding the automatic split.
        balance: "layers" splits by layer count; "params"/"flops" balance stage cost
            automatically (FLOPs need `seq_len`).
        csv_path: run the schedule written in this CSV (one row per rank, torch's action
            syntax such as `0F1`, `1B0`, `0W0`); stage ownership is read from it.
    """
    if local_batch_size < 1 or microbatch_size < 1 or local_batch_size % microbatch_size:
        raise ConfigError(
            f"[training] local_batch_size = {local_batch_size} does not split into microbatches of"
            f" [parallelism] pipeline_parallel_microbatch_size = {microbatch_size}\n"
            "choose a microbatch size that divides the local batch size"
        )
    n_microbatches = local_batch_size // microbatch_size

    csv_ids: list[list[int]] | None = None
    wanted: int | None  # stages the schedule asks for, when the split does not fix it
    if csv_path is not None:
        csv_ids, has_comms = _csv_stage_ids(Path(csv_path), pp_degree)
        if has_comms:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule_csv = {csv_path} contains communication"
                " actions (SEND_F, RECV_B, ...)\nwrite compute actions only (F, B, I, W); the"
                " runtime adds the sends and receives"
            )
        name, style = "custom CSV", None
        wanted = max(max(ids, default=-1) for ids in csv_ids) + 1
    else:
        name = schedule_name(schedule)
        style = SCHEDULES[name]
        default_per_rank = 1 if style == "single" else 2
        wanted = pp_degree * (stages_per_rank or default_per_rank)
        if split_points is not None or layers_per_stage is not None:
            wanted = None

    if split_points is not None:
        names_per_stage = validate_split_points(model, split_points)
    elif layers_per_stage is not None or balance == "layers":
        names_per_stage = split_by_layers(
            model,
            wanted,
            layers_per_stage=layers_per_stage,
            first_stage_less_layers=first_stage_less_layers,
            last_stage_less_layers=last_stage_less_layers,
        )
    else:
        names_per_stage = split_balanced(model, wanted or pp_degree, by=balance, seq_len=seq_len)
    num_stages = len(names_per_stage)

    if csv_ids is not None:
        if num_stages != wanted:
            raise ConfigError(
                f"[parallelism] the schedule CSV uses {wanted} stages but the model split has"
                f" {num_stages}\nmake the split (split points / layers per stage) match the CSV"
            )
        empty = [rank for rank, ids in enumerate(csv_ids) if not ids]
        if empty:
            raise ConfigError(f"the schedule CSV gives pipeline rank {empty[0]} no stage to run")
        per_rank = csv_ids
    else:
        assert style is not None
        _check_microbatches(name, n_microbatches, num_stages, pp_degree)
        per_rank = [
            pipeline_stage_ids(style, r, pp_degree, num_stages // pp_degree)
            for r in range(pp_degree)
        ]
    return PipelinePlan(name, names_per_stage, per_rank, n_microbatches)


def schedule_name(schedule: str) -> str:
    """The canonical name of a schedule in `SCHEDULES` (case-insensitive), or a ConfigError."""
    name = next((n for n in SCHEDULES if n.lower() == schedule.lower()), None)
    if name is None:
        raise ConfigError(
            f"[parallelism] pipeline_parallel_schedule = {schedule!r} is not a schedule\n"
            f"choose one of {', '.join(SCHEDULES)}, or give pipeline_parallel_schedule_csv"
        )
    return name


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    parallelize_fn: Callable[[nn.Module], nn.Module | None] | None = None,
    stage_io: StageIO | None = None,
    **split: Any,
) -> Pipeline:
    """Split `model` (built on the meta device) into pipeline stages and build the schedule.

    Args:
        pp_mesh: the pipeline mesh, `ParallelDims.mesh("pp")`.
        loss_fn: `loss_fn(logits, labels)` returning the mean loss of one microbatch.
        parallelize_fn: applied to each stage module before its PipelineStage is made (it may
            also be applied by the caller afterwards, in place).
        stage_io: static shapes of what flows between stages (see `infer_stage_io`); without
            it the stages exchange shapes at their first step.
        split: how the model is cut and scheduled: the keywords of `plan_pipeline`
            (`microbatch_size` and `local_batch_size` required), checked there.
    """
    pp_degree, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    plan = plan_pipeline(model, pp_degree, **split)
    name, names_per_stage, num_stages = plan.schedule, plan.names_per_stage, plan.num_stages
    n_microbatches = plan.n_microbatches
    stage_ids = plan.stage_ids_per_rank[pp_rank]
    parts = build_stage_modules(model, names_per_stage, stage_ids)
    if parallelize_fn is not None:
        parts = [parallelize_fn(part) or part for part in parts]
    group = pp_mesh.get_group()
    stages = [
        PipelineStage(
            part, sid, num_stages, device, group=group, **_stage_kwargs(stage_io, sid, num_stages)
        )
        for part, sid in zip(parts, stage_ids)
    ]
    for stage in stages:
        _skip_warmup_with_itself(stage, pp_rank)
    scaled = _MicrobatchLoss(loss_fn, n_microbatches)

    if (csv_path := split.get("csv_path")) is not None:
        sched: _PipelineSchedule = _PipelineScheduleRuntime(
            stages, n_microbatches=n_microbatches, loss_fn=scaled, scale_grads=False
        )
        sched._load_csv(str(csv_path), format="compute_only")
    elif issubclass(cls := get_schedule_class(name), PipelineScheduleSingle):
        sched = cls(stages[0], n_microbatches=n_microbatches, loss_fn=scaled, scale_grads=False)
    else:
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=scaled, scale_grads=False)

    return Pipeline(
        schedule=sched,
        stages=stages,
        model_parts=parts,
        stage_ids=stage_ids,
        num_stages=num_stages,
        n_microbatches=n_microbatches,
        has_first=0 in stage_ids,
        has_last=num_stages - 1 in stage_ids,
        loss=scaled,
        eval_problem=plan.eval_problem,
    )


def broadcast_pipeline_loss(
    loss: torch.Tensor | None, pp_mesh: DeviceMesh, device: torch.device
) -> torch.Tensor:
    """The step loss on every pipeline rank, for logging.

    Only the rank holding the last stage has it; the others pass None. One all-reduce
    (a sum where only one rank contributes) works for every stage layout, V-shaped included.
    """
    value = (
        torch.zeros((), dtype=torch.float32, device=device)
        if loss is None
        else loss.detach().float().clone()
    )
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return value


def pp_total_norm(
    local_norm: torch.Tensor, pp_mesh: DeviceMesh | None, norm_type: float = 2.0
) -> torch.Tensor:
    """The gradient norm of the whole model from each pipeline rank's norm of its own stages.

    `local_norm` is the norm over this rank's parameters (a DTensor under FSDP/TP is made
    full first). For a p-norm the p-th powers add across ranks; for the infinity norm the
    maximum is taken. Use the result in place of the local norm when clipping.
    """
    if hasattr(local_norm, "full_tensor"):
        local_norm = local_norm.full_tensor()
    if pp_mesh is None or pp_mesh.size() == 1:
        return local_norm
    group = pp_mesh.get_group()
    norm = local_norm.detach().float().clone()
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm**norm_type
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm ** (1.0 / norm_type)
