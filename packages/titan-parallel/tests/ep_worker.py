"""Expert-parallel training cases on real gloo groups (started by parity_worker's launcher):
a user's MoE transformer (moe_testmodel) trained for a few AdamW steps under one layout,
recording what the test compares with one process: losses, gradient norms, the first step's
full gradients, the final weights and expert biases, and the initial weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from moe_testmodel import MoEArgs, TinyMoE
from parallel_testmodel import cross_entropy

SEED = 4321
STEPS = 5
BATCH, SEQ = 4, 16
LR = 1e-2
MAX_NORM = 1.0


@dataclass(frozen=True)
class EPCase:
    name: str
    world: int
    ep: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    sp: bool = True
    ac: str = "none"
    compile: bool = False
    experts: int = 8
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, MoEArgs().vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _canonical(name: str) -> str:
    from titan_core.init import canonical_name

    return canonical_name(name)


def _gathered(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's entries (pipeline stages hold different names), on every rank."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def _states(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return _gathered(
        {
            _canonical(k): _full(v).detach().clone()
            for part in parts
            for k, v in part.state_dict().items()
        }
    )


def _grads(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return _gathered(
        {
            _canonical(n): _full(p.grad).detach().clone()
            for part in parts
            for n, p in part.named_parameters()
            if p.grad is not None
        }
    )


def build_optimizer(name: str, parts: list[torch.nn.Module]) -> torch.optim.Optimizer:
    """AdamW, or Muon (fp32 Newton-Schulz) for the hidden matrices, each 3-D expert weight a
    stack of matrices orthogonalised one by one, and AdamW for the router, embeddings, norms
    and head (`muon_owner`: sharded matrices dealt out to one rank each)."""
    from titan_parallel import Muon, muon_param_groups

    if name == "adamw":
        return torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    groups = [g for part in parts for g in muon_param_groups(part)]
    distributed = "owner" if name == "muon_owner" else "gather"
    return Muon(groups, lr=LR, ns_dtype=torch.float32, distributed=distributed)


def reference(experts: int = 8, optimizer: str = "adamw") -> dict:
    """The same steps in this one process, unsharded."""
    from titan_parallel import init_weights_exact

    model = TinyMoE(MoEArgs(num_experts=experts))
    init_weights_exact(model, SEED)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = build_optimizer("muon" if optimizer.startswith("muon") else optimizer, [model])
    x, y = batch()
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss = cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        model.balance_experts()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "initial": initial,
        "final": dict(model.state_dict()),
    }


def run_ep_case(case: EPCase) -> dict:
    from titan_parallel import (
        ActivationCheckpoint,
        Compile,
        Parallelism,
        broadcast_pipeline_loss,
        build_pipeline,
        clip_grad_norm_,
        cp_context,
        dist_mean,
        enable_cpu_ring_attention,
        init_weights_exact,
        loss_context,
        parallelize,
    )

    cfg = Parallelism(
        data_parallel_replicate_degree=case.dp_replicate,
        tensor_parallel_degree=case.tp,
        pipeline_parallel_degree=case.pp,
        context_parallel_degree=case.cp,
        expert_parallel_degree=case.ep,
        enable_sequence_parallel=case.sp,
    )
    dims = cfg.build_parallel_dims(dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = TinyMoE(MoEArgs(num_experts=case.experts))
    x, y = batch()
    dp = dims.mesh("dp")
    if dp is not None:  # each data-parallel rank its share of the batch
        x, y = x.chunk(dp.size())[dp.get_local_rank()], y.chunk(dp.size())[dp.get_local_rank()]
    pipe, pp_mesh = None, dims.mesh("pp")
    if pp_mesh is not None:
        pipe = build_pipeline(
            model,
            pp_mesh,
            schedule="1F1B",
            microbatch_size=1,
            local_batch_size=x.shape[0],
            loss_fn=cross_entropy,
            device=torch.device("cpu"),
        )
        parts = pipe.model_parts
    else:
        parts = [model]
    for part in parts:
        parallelize(
            part,
            dims,
            part.tp_plan() if dims.tp_enabled else None,
            parallelism=cfg,
            ac=ActivationCheckpoint(mode=case.ac),
            compile=Compile(enable=case.compile, backend="aot_eager"),
        )
        part.to_empty(device="cpu")
        init_weights_exact(part, SEED)
    if dims.cp_enabled:
        enable_cpu_ring_attention()
    initial = _states(parts)
    params = [p for part in parts for p in part.parameters()]
    opt = build_optimizer(case.extra.get("optimizer", "adamw"), parts)
    dp_cp = dims.mesh("dp_cp")
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        if pipe is not None:
            loss = broadcast_pipeline_loss(pipe.step(x, y), pp_mesh, torch.device("cpu"))
        else:
            xs, ys = x.clone(), y.clone()  # CP shards them in place
            with (
                cp_context(dims.mesh("cp"), [xs, ys], [1, 1], {xs, ys})
                if dims.cp_enabled
                else loss_context(dims, cfg)
            ):
                loss = cross_entropy(model(xs), ys)
                loss.backward()
        if step == 0:
            grads = _grads(parts)
        norms.append(clip_grad_norm_(params, MAX_NORM, pp_mesh=pp_mesh).item())
        opt.step()
        opt.zero_grad()
        for part in parts:  # counts from every rank that saw other tokens
            part.balance_experts(dp_cp.get_group() if dp_cp is not None else None)
        losses.append(dist_mean(loss, dp_cp))
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "initial": initial,
        "final": _states(parts),
        "layout": _expert_layout(parts),
        **({"muon_paths": dict(opt.paths)} if hasattr(opt, "paths") else {}),
    }


def _expert_layout(parts: list[torch.nn.Module]) -> str:
    """How the first MoE layer's w1 is laid out on this rank: mesh dimensions and placements."""
    w1 = next(moe.experts.w1 for part in parts for moe in part.moe_layers())
    if not hasattr(w1, "device_mesh"):
        return "plain"
    return f"{w1.device_mesh.mesh_dim_names} {w1.placements}"
