"""Expert parallel (EP) and tensor parallel (TP) for mixture-of-experts layers, from the plan
each layer gives as data (`titan_core.MoEPlan`, from its `moe_plan()` method).

Expert parallel: each rank of the EP mesh holds num_experts / ep whole experts (the stacked
expert weights become DTensors sharded along dimension 0), and the layer's call of its experts
sends every routed token copy to the rank that holds its expert and the results back (see
`token_dispatch`). Routing, counting and weighing stay in the layer, on each rank's own
tokens. The EP ranks are borrowed from data parallel (dp_shard x cp, see
`titan_core.ParallelDims`): they see different tokens, so every expert receives work from all
of them. FSDP then shards the expert weights over the ranks EP leaves (`ep_fsdp`), and since
each expert's gradient already sums the contributions of its EP group, the reduction divides
by the whole data-parallel degree, as for every other weight (`apply_fsdp` does both).

Tensor parallel on a MoE layer (with or without EP): the layer receives the whole sequence
(gathered from sequence-parallel shards), routes it identically on every TP rank, and each
rank computes its slice of every expert's hidden features (expert TP: w1/w3 split along their
outputs, w2 along its inputs) and of the shared experts'. Its output is thus a partial sum,
reduced over the TP ranks at the layer's end (scattered along the sequence under sequence
parallel). In backward, the gradients that flow into what every TP rank holds whole (the
tokens entering the experts, the routing weights that scale partial outputs) are summed over
the TP ranks, so the router, which every rank runs alike, gets the same exact gradient
everywhere.

Apply `apply_ep` after `apply_tp` and before activation checkpointing, compile and FSDP;
`parallelize` does, whenever the model has MoE layers and EP or TP is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from titan_core.config import ConfigError
from titan_core.init import canonical_name
from titan_core.parallel_dims import ParallelDims
from titan_core.protocols import MoEPlan, TPPlan
from titan_parallel.tensor_parallel import _GatherSequence, block_plan
from titan_parallel.token_dispatch import Exchange, combine, dispatch

_SPLIT_DIM = {"colwise": 2, "rowwise": 1}  # of a stacked (experts, in, out) weight


@dataclass(frozen=True)
class ExpertShards:
    """Left on an experts module by `apply_ep`: how FSDP must shard its weights."""

    fsdp_mesh: DeviceMesh
    """The ranks that hold the same experts (dp_shard x cp / ep, with dp_replicate for HSDP)."""
    divide_factor: float
    """What the summed gradient is divided by: the whole data-parallel degree."""
    ep: int


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module, MoEPlan]]:
    """(name, module, plan) of every module in `model.layers` that gives a `moe_plan()`."""
    found = []
    for key, block in getattr(model, "layers", nn.ModuleDict()).items():
        for name, module in block.named_modules():
            plan_fn = getattr(module, "moe_plan", None)
            if callable(plan_fn):
                full = canonical_name(f"layers.{key}.{name}".rstrip("."))
                found.append((full, module, plan_fn()))
    return found


def expert_parallel_problems(model: nn.Module, *, ep: int, tp: int) -> list[str]:
    """What stops `model`'s MoE layers from being split over `ep` expert-parallel and `tp`
    tensor-parallel ranks (empty when nothing does). Works on a meta-device model."""
    layers = moe_layers(model)
    if ep > 1 and not layers:
        return [
            f"[parallelism] expert_parallel_degree = {ep} needs a mixture-of-experts model, and"
            f" {type(model).__name__} has no MoE layer (a module in its blocks with moe_plan())\n"
            "set expert_parallel_degree = 1"
        ]
    for name, layer, plan in layers:  # the first layer with a problem speaks for the rest
        problems = _plan_problems(name, layer, plan)
        if problems:
            return problems
        if plan.num_experts % ep:
            problems.append(
                f"[parallelism] expert_parallel_degree = {ep} does not divide the {plan.num_experts}"
                f" experts of {name}\nchoose a degree that divides {plan.num_experts}"
            )
        if tp > 1:
            problems += _tp_problems(name, layer, plan, tp)
        if problems:
            return problems
    return []


def tp_plan_overlaps(model: nn.Module, tp_plan: TPPlan) -> list[str]:
    """Entries of a model's `TPPlan` that name a MoE layer or anything inside one: such a layer
    is split by its own `moe_plan()`, and splitting it twice would gather its input twice."""
    overlaps = []
    for name, _, _ in moe_layers(model):
        _, key, inside = name.split(".", 2)  # layers.<key>.<the layer, relative to its block>
        styles = block_plan(tp_plan, key)
        overlaps += [n for n in styles if (n == inside or n.startswith(inside + ".")) and n not in overlaps]  # fmt: skip
    if not overlaps:
        return []
    return [
        f"the tensor-parallel plan names {', '.join(overlaps)}, inside a mixture-of-experts layer,"
        " which its moe_plan() splits\nremove those entries from tp_plan() (keep the norm"
        " before the layer)"
    ]


def _plan_problems(name: str, layer: nn.Module, plan: MoEPlan) -> list[str]:
    missing, unstacked = [], []
    experts = _get(layer, plan.experts)
    if experts is None:
        missing.append(plan.experts)
    else:
        for w in plan.expert_weights:
            weight = getattr(experts, w, None)
            if not isinstance(weight, torch.Tensor):
                missing.append(f"{plan.experts}.{w}")
            elif weight.dim() not in (2, 3) or weight.shape[0] != plan.num_experts:
                unstacked.append(f"{plan.experts}.{w}")
    missing += [n for n in (plan.router, *plan.shared_experts) if _get(layer, n) is None]
    problems = []
    if missing:
        problems.append(
            f"{name}.moe_plan() names what the layer does not have: {', '.join(missing)}\n"
            "fix the plan's names (relative to the layer)"
        )
    if unstacked:
        problems.append(
            f"{name}.moe_plan(): {', '.join(unstacked)} must stack the experts along dimension 0,"
            f" shaped (num_experts = {plan.num_experts}, in, out), or (num_experts, out) for a bias"
        )
    return problems


def _tp_problems(name: str, layer: nn.Module, plan: MoEPlan, tp: int) -> list[str]:
    sizes = {
        f"{plan.experts}.{w}": weight.shape[_split_dim(weight, split)]
        for w, split in plan.expert_weights.items()
        if (weight := getattr(_get(layer, plan.experts), w)) is not None
    }
    for module_name, split in plan.shared_experts.items():
        linear = _get(layer, module_name)
        sizes[module_name] = linear.weight.shape[0 if split == "colwise" else 1]
    return [
        f"[parallelism] tensor_parallel_degree = {tp} does not divide the {size} hidden features"
        f" of {name}.{what}\nchoose a tensor_parallel_degree that divides {size}"
        for what, size in sizes.items()
        if size % tp
    ]


def _get(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def apply_ep(model: nn.Module, dims: ParallelDims, *, sequence_parallel: bool = True) -> None:
    """Split `model`'s MoE layers over the EP and TP meshes of `dims` (in place, on the meta
    device, after `apply_tp`). Does nothing when neither EP nor TP is on, or the model has no
    MoE layer. Raises `ConfigError` (before changing anything) when the layout cannot split them.
    """
    layers = moe_layers(model)
    if not layers or not (dims.ep_enabled or dims.tp_enabled):
        return
    problems = expert_parallel_problems(model, ep=dims.ep, tp=dims.tp)
    if problems:
        raise ConfigError(problems)
    tp_mesh = dims.mesh("tp")
    for _, layer, plan in layers:
        experts = layer.get_submodule(plan.experts)
        _shard_experts(experts, plan, dims)
        hooks = _ExpertHooks(dims.mesh("ep") if dims.ep_enabled else None, tp_mesh)
        experts.register_forward_pre_hook(hooks.before)
        experts.register_forward_hook(hooks.after)
        if dims.ep_enabled:
            experts._titan_expert_shards = ExpertShards(
                dims.mesh("ep_fsdp"), float(dims.degree("fsdp")), dims.ep
            )
        if tp_mesh is not None:
            _apply_layer_tp(layer, plan, tp_mesh, sequence_parallel)


def expert_shards(model: nn.Module) -> list[tuple[nn.Module, ExpertShards]]:
    """The experts modules `apply_ep` split over EP ranks, with what FSDP needs to know."""
    return [
        (m, m._titan_expert_shards) for m in model.modules() if hasattr(m, "_titan_expert_shards")
    ]


def _split_dim(param: torch.Tensor, split: str) -> int:
    """The dimension expert TP splits: of a stacked weight (experts, in, out) as `_SPLIT_DIM`
    says; of a stacked bias (experts, out), its last (a colwise weight's bias)."""
    return _SPLIT_DIM[split] if param.ndim == 3 else param.ndim - 1


def _shard_experts(experts: nn.Module, plan: MoEPlan, dims: ParallelDims) -> None:
    for name, split in plan.expert_weights.items():
        param = experts.get_parameter(name)
        if dims.ep_enabled and dims.tp_enabled:
            mesh, placements = dims.mesh("ep_tp"), [Shard(0), Shard(_split_dim(param, split))]
        elif dims.ep_enabled:
            mesh, placements = dims.mesh("ep"), [Shard(0)]
        else:
            mesh, placements = dims.mesh("tp"), [Shard(_split_dim(param, split))]
        sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


class _ExpertHooks:
    """Around one experts module's call: under TP, sum the gradient of its input over the TP
    ranks; under EP, dispatch its input rows and combine its output rows."""

    def __init__(self, ep_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None):
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None else None
        self.tp_mesh = tp_mesh
        self._pending: list[Exchange] = []  # dispatched, not yet combined (one per call)

    def before(self, _module: nn.Module, args: tuple) -> tuple:
        x, counts, *rest = args
        if self.tp_mesh is not None:
            x = _sum_grad_over(x, self.tp_mesh)
        if self.ep_group is not None:
            x, counts = self._dispatch(x, counts)
        return (x, counts, *rest)

    def after(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out if self.ep_group is None else self._combine(out)

    # The exchange reads split sizes on the host: it runs between compiled graphs.
    @torch.compiler.disable
    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, counts, exchange = dispatch(x, counts, self.ep_group)
        self._pending.append(exchange)
        return x, counts

    @torch.compiler.disable
    def _combine(self, out: torch.Tensor) -> torch.Tensor:
        return combine(out, self._pending.pop())


def _apply_layer_tp(layer: nn.Module, plan: MoEPlan, tp_mesh: DeviceMesh, sp: bool) -> None:
    shared = {
        name: ColwiseParallel() if split == "colwise" else RowwiseParallel(output_layouts=Partial())
        for name, split in plan.shared_experts.items()
    }
    if shared:
        parallelize_module(layer, tp_mesh, shared)
    _replicate_router(layer.get_submodule(plan.router), tp_mesh, plan.weights_scale_outputs)
    if sp:
        _GatherSequence()._apply(layer, tp_mesh)
    target = Shard(1) if sp else Replicate()
    layer.register_forward_hook(lambda _m, _a, out: _reduce_partial(out, tp_mesh, target))


def _replicate_router(router: nn.Module, tp_mesh: DeviceMesh, weights_scale_outputs: bool) -> None:
    """The router runs alike on every TP rank: its weights become replicated DTensors (like
    every other weight under TP), its tensor inputs replicated DTensors and its outputs local
    tensors again. The routing weights' gradient is summed over the TP ranks when they scale
    the experts' (partial) outputs; the rest of its gradients are whole on every rank."""

    def inputs(_module, args, mesh):
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(_module, out, mesh):
        summed = [Partial()] if weights_scale_outputs else [Replicate()]
        return tuple(
            o.to_local(grad_placements=summed if i == 0 else [Replicate()])
            if isinstance(o, DTensor)
            else o
            for i, o in enumerate(out)
        )

    distribute_module(router, tp_mesh, input_fn=inputs, output_fn=outputs)


def _sum_grad_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """`x` unchanged; in backward, its gradient summed over `mesh` (each rank adds a part)."""
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.to_local(grad_placements=[Partial()])


def _reduce_partial(x: torch.Tensor, mesh: DeviceMesh, placement) -> torch.Tensor:
    """Partial sums over `mesh` -> their sum, scattered along `placement` or replicated; in
    backward, the gradient gathered."""
    partial = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    return partial.redistribute(placements=[placement]).to_local()
