"""Tensor parallel (with sequence parallel and loss parallel) from a model's `TPPlan`.

A `TPPlan` names submodules and gives each a `TPStyle`; `apply_tp` turns each style into one
of torch's `ParallelStyle`s. Activations are laid out [batch, sequence, ...]: under sequence
parallel (SP), the tensors between blocks are split along dim 1 across the TP ranks, the norms
run on those shards, and each block's attention/feed-forward gathers the full sequence first.

Loss parallel keeps the output projection's logits split along the vocabulary and computes the
cross entropy on the shards; run the loss and its backward inside `loss_context(...)`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from titan_core.config import ConfigError
from titan_core.messages import shortlist
from titan_core.parallel_dims import ParallelDims
from titan_core.protocols import TPPlan, TPStyle
from titan_parallel.config import Parallelism
from titan_parallel.tied import retie, tied_parameter_groups


class _GatherSequence(ParallelStyle):
    """Turns a module's first positional input from sequence shards into the full sequence;
    other inputs (masks, rotary tables, scalars) pass through unchanged, so the module may
    take any number of them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple) -> tuple:
            x, *rest = args
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return (x.redistribute(placements=(Replicate(),)).to_local(), *rest)

        module.register_forward_pre_hook(gather)
        return module


class _SumOutputGradient(ParallelStyle):
    """A replicated module whose output every rank uses with its own heads only (DeepSeek's
    rotary key, shared by all heads): the forward is unchanged, and the output's gradient,
    of which each rank holds the part from its heads, is summed over the ranks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_gradient(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            replicated = DTensor.from_local(out, device_mesh, (Replicate(),), run_check=False)
            return replicated.to_local(grad_placements=(Partial(),))

        module.register_forward_hook(sum_gradient)
        return module


class _ShardByHeads(ParallelStyle):
    """A module holding one value per query head (attention sinks) and returning it: its
    parameters are sharded on dim 0 as the heads are, and it returns the rank's own part
    (a plain tensor, whose gradient lands in the rank's shard)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), device_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, param.requires_grad))

        def local(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            return out.to_local() if isinstance(out, DTensor) else out

        module.register_forward_hook(local)
        return module


def _style(style: TPStyle, *, sp: bool, loss_parallel_on: bool) -> ParallelStyle | None:
    """The torch ParallelStyle for one TPStyle, or None when the module stays as it is."""
    seq = Shard(1) if sp else Replicate()
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if style == "sequence_parallel":
        return SequenceParallel() if sp else None
    if style == "block_input":
        return _GatherSequence() if sp else None
    if style == "embedding":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style == "output":
        return ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
            use_local_output=not loss_parallel_on,
        )
    if style == "per_head":
        # Each rank holds its own heads (dim 2): the weight, the same for every head, is
        # replicated and its gradient summed over the ranks, with or without SP.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style == "head_shared":
        return _SumOutputGradient()
    if style == "per_head_param":
        return _ShardByHeads()
    if style == "per_token":
        # Like a norm under SP, but its output is what the next block's residual adds to:
        # a plain tensor, as the blocks pass on.
        return SequenceParallel(use_local_output=True) if sp else None
    raise ValueError(
        f"unknown TPStyle {style!r}; known: colwise, rowwise, sequence_parallel, block_input,"
        " embedding, output, per_head, head_shared, per_head_param, per_token"
    )


def _has_path(module: nn.Module, name: str) -> bool:
    for part in name.split("."):
        if module is None:  # removed by pipeline parallel: present in the model's design
            return True
        if part not in module._modules:
            return False
        module = module._modules[part]
    return True


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    for part in name.split("."):
        module = module._modules.get(part) if module is not None else None
    return module


def check_tp_plan(model: nn.Module, plan: TPPlan, tp_degree: int) -> list[str]:
    """Problems that stop `plan` from applying to `model` at this TP degree."""
    problems = [
        f"{name} = {size} does not divide by tensor_parallel_degree {tp_degree}\n"
        f"choose a tensor_parallel_degree that divides {name}"
        for name, size in plan.divisible_by_tp.items()
        if size % tp_degree
    ]
    missing = [n for n in plan.root if not _has_path(model, n)]
    layers = getattr(model, "layers", None)
    if layers is not None:
        for block_name, block in layers.items():
            names = block_plan(plan, block_name)
            missing += [f"layers.{block_name}.{n}" for n in names if not _has_path(block, n)]
    if missing:
        problems.append(
            "the tensor-parallel plan names modules the model does not have:"
            f" {shortlist(missing, 5)}\nfix the model's tp_plan() to use module names relative to"
            " the root or to a block"
        )
    return problems


def block_plan(plan: TPPlan, key: str) -> Mapping[str, TPStyle]:
    """The styles of block `key` of `layers`: its own entry in `plan.blocks`, else `plan.block`."""
    return plan.blocks.get(key, plan.block)


def _module_styles(model: nn.Module, plan: TPPlan) -> dict[str, TPStyle]:
    """The style of every module the plan names, by fully qualified name."""
    styles = {n: s for n, s in plan.root.items() if _submodule(model, n) is not None}
    for key in getattr(model, "layers", nn.ModuleDict()):
        styles.update({f"layers.{key}.{n}": s for n, s in block_plan(plan, key).items()})
    return styles


def _split_of(
    module: nn.Module, leaf: str, style: ParallelStyle | None, mesh: DeviceMesh
) -> tuple[str, ...]:
    """How `style` leaves `module`'s parameter `leaf`: its placements, or () when it stays a
    plain tensor. Found by applying the style to a copy of the module on the meta device,
    so it is torch's own answer, at no memory and no communication."""
    if style is None:
        return ()
    memo = {
        id(t): (
            nn.Parameter(t.to("meta"), t.requires_grad)
            if isinstance(t, nn.Parameter)
            else t.to("meta")
        )
        for t in [*module.parameters(), *module.buffers()]
    }
    skeleton = copy.deepcopy(module, memo)
    parallelize_module(skeleton, mesh, style)
    param = skeleton._parameters[leaf]
    return tuple(map(repr, param.placements)) if isinstance(param, DTensor) else ()


def check_tied_parameters(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
) -> list[str]:
    """Problems with parameters that several modules share under this plan: each of them
    must be split the same way (or not at all) in every module that holds it."""
    named = _module_styles(model, plan)
    problems = []
    for group in tied_parameter_groups(model):
        splits = {}
        for name in group:
            path, _, leaf = name.rpartition(".")
            style_name = named.get(path)
            style = (
                _style(style_name, sp=sequence_parallel, loss_parallel_on=loss_parallel)
                if style_name
                else None
            )
            split = _split_of(model.get_submodule(path), leaf, style, tp_mesh)
            splits[name] = (style_name, split)
        if len({split for _, split in splits.values()}) > 1:
            described = "; ".join(
                f"{name}: {style or 'not in the plan'} -> {'/'.join(split) or 'not split'}"
                for name, (style, split) in splits.items()
            )
            problems.append(
                f"{' and '.join(group)} are one tied parameter, but the tensor-parallel plan splits it"
                f" differently in each module ({described})\n"
                "give every module that holds it a style that splits it the same way (for a tied"
                " embedding and output projection: embedding and output), or untie the weights"
            )
    return problems


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    async_tp: bool = False,
) -> None:
    """Split `model`'s modules over `tp_mesh` as `plan` says (in place, before FSDP).

    Root entries whose module was removed (set to None by pipeline parallel) are skipped.
    A parameter that several modules hold (tied embeddings) stays one parameter; the plan
    must split it the same way in each of them, else a `ConfigError` is raised first.
    `async_tp` turns on symmetric-memory collectives for the compiler's async-TP pass (CUDA
    only; the blocks must also be compiled).
    """
    degree = tp_mesh.size()
    problems = check_tp_plan(model, plan, degree)
    if problems:
        raise ConfigError(problems)
    tied = tied_parameter_groups(model)
    if tied:
        problems = check_tied_parameters(
            model, tp_mesh, plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel
        )
        if problems:
            raise ConfigError(problems)
    if async_tp and tp_mesh.device_type != "cuda":
        raise ConfigError(
            f"async tensor parallel needs CUDA, but the mesh is on {tp_mesh.device_type}\n"
            "turn off enable_async_tensor_parallel"
        )
    styles = dict(sp=sequence_parallel, loss_parallel_on=loss_parallel)
    root = {n: s for n, st in plan.root.items() if (s := _style(st, **styles)) is not None}
    root = {n: s for n, s in root.items() if _submodule(model, n) is not None}
    if root:
        parallelize_module(model, tp_mesh, root)
    for key, block in getattr(model, "layers", nn.ModuleDict()).items():
        names = block_plan(plan, key).items()
        parallelize_module(
            block, tp_mesh, {n: s for n, st in names if (s := _style(st, **styles)) is not None}
        )
    # Each module got a split copy of a tied parameter (split the same way, checked above):
    # hold one again, so that both uses add into one gradient.
    retie(model, tied)
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def copy_block_inputs(model: nn.Module) -> None:
    """Make what the modules before the blocks (`model.pre_blocks`) return a tensor of its
    own instead of a view of a DTensor's local shard.

    Under TP the embedding returns `to_local()` of its output, a view. When the first block is
    compiled, AOTAutograd replays that view from its base in backward and the gradient skips
    DTensor's own backward, which then fails ("'Tensor' object has no attribute
    '_local_tensor'"); under FSDP an in-place op on the view would drop FSDP's backward hook.
    One copy of one activation per step avoids both; `parallelize` does it whenever TP is on.
    """
    for name in getattr(model, "pre_blocks", ()):
        module = getattr(model, name, None)
        if module is not None:
            module.register_forward_hook(_own_output)


def _own_output(_module: nn.Module, _args: tuple, output):
    return (
        output.clone() if isinstance(output, torch.Tensor) and output._base is not None else output
    )


def loss_context(
    dims: ParallelDims, parallelism: Parallelism | None = None
) -> contextlib.AbstractContextManager:
    """The context to compute the loss and run its backward in: torch's `loss_parallel()`
    when TP is on and loss parallel is not disabled, else a no-op.

        with loss_context(dims, cfg.parallelism):
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
    """
    parallelism = parallelism or Parallelism()
    if dims.tp_enabled and not parallelism.disable_loss_parallel:
        return loss_parallel()
    return contextlib.nullcontext()
