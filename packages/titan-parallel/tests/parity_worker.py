"""Runs training cases on a real gloo process group, started once per world size.

`run_cases(world_size, cases)` spawns the ranks, each of which loops over `cases`, and returns
rank 0's results: per case the global losses, gradient norms and the final full parameters
(or the error text). `reference(model_name)` runs the same steps in this one process, unsharded.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gpt2_usermodel import GPT2
from parallel_testmodel import TinyArgs, TinyTransformer, cross_entropy

SEED = 1234
STEPS = 3
BATCH, SEQ = 4, 8
LR = 1e-2
MAX_NORM = 1.0  # small enough that clipping engages on the first steps


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    dp_shard: int = -1
    dp_replicate: int = 1
    tp: int = 1
    sp: bool = True
    loss_parallel: bool = True
    reshard: str = "default"
    cpu_offload: bool = False
    ac: str = "none"
    ac_option: str = "op"
    compile: bool = False
    compile_backend: str = "aot_eager"
    param_dtype: str = "float32"
    model: str = "tiny"
    """`tiny` (parallel_testmodel) or `gpt2` (a user's GPT-2-style model with tied embeddings)."""
    optimizer: str = "adamw"
    """A name in `OPTIMIZERS`."""
    steps: int = STEPS
    pp: int = 1
    """Pipeline stages (1F1B, one per rank); the other ranks shard each stage with FSDP."""
    extra: dict = field(default_factory=dict, hash=False, compare=False)


MODELS = {"tiny": TinyTransformer, "gpt2": GPT2}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, TinyArgs().vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def state_vector(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name (wrapper prefixes removed), identical on every rank."""
    return {k: _full(v).detach().float().clone() for k, v in model.state_dict().items()}


def shared_names(model: torch.nn.Module) -> list[list[str]]:
    """Names of each parameter object held under more than one name (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(group for group in names.values() if len(group) > 1)


# Ranger21 with every component on, over 5 steps: warm-up over the first 2, warm-down from
# the 5th (72% of 6 steps), the positive and the negative momentum both used, one Lookahead
# merge at step 5.
RANGER21 = dict(lr=LR, total_steps=6, warmup_steps=2, lookahead_steps=5)


# Muon over 5 steps with Newton-Schulz in fp32 (bf16 would round differently on each layout's
# slightly different gradients), Moonlight's scale, weight decay on both kinds.
MUON = dict(lr=2e-2, weight_decay=0.1, ns_dtype=torch.float32, adjust_lr="match_rms_adamw")


def build_optimizer(
    name: str, params, pipeline_group=None, modules: list | None = None
) -> torch.optim.Optimizer:
    from titan_parallel import Muon, Ranger21, muon_param_groups

    if name in ("muon", "muon_owner"):
        # Hidden matrices by Muon, embeddings, norms and the head by AdamW, per module (the
        # stages of a pipeline rank); `owner` deals the sharded matrices out to one rank each.
        muon, adamw = [], []
        for module in modules:
            for group in muon_param_groups(module):
                (muon if group["use_muon"] else adamw).extend(group["params"])
        groups = [{"params": muon, "use_muon": True}, {"params": adamw, "use_muon": False}]
        distributed = "owner" if name == "muon_owner" else "gather"
        return Muon(groups, **MUON, distributed=distributed)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR)
    if name == "ranger21":
        return Ranger21(params, **RANGER21, pipeline_group=pipeline_group)
    if name == "ranger21_madgrad":
        return Ranger21(params, **RANGER21, core="madgrad", pipeline_group=pipeline_group)
    if name == "ranger21_compiled":  # the fused kernels of ranger21_kernels
        return Ranger21(params, **RANGER21, compiled=True, pipeline_group=pipeline_group)
    raise ValueError(name)


def reference(model_name: str = "tiny", optimizer: str = "adamw", steps: int = STEPS) -> dict:
    """The same training steps, unsharded, in this one process."""
    model = MODELS[model_name]()
    torch.manual_seed(SEED)
    model.init_weights()
    initial = state_vector(model)
    opt = build_optimizer(optimizer, model.parameters(), modules=[model])
    x, y = batch()
    losses, norms = [], []
    for _ in range(steps):
        loss = cross_entropy(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "initial": initial,
        "params": state_vector(model),
        "tied": shared_names(model),
    }


def run_pp_case(case: Case) -> dict:
    """Pipeline stages (1F1B, one per rank of the pp dimension), FSDP over the other ranks."""
    from titan_core import ParallelDims
    from titan_parallel import (
        apply_fsdp,
        broadcast_pipeline_loss,
        build_pipeline,
        clip_grad_norm_,
        dist_mean,
    )

    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, pp=case.pp, dp_shard=world // case.pp)
    dims.build_mesh("cpu")
    ref = MODELS[case.model]()
    torch.manual_seed(SEED)
    ref.init_weights()
    with torch.device("meta"):
        model = MODELS[case.model]()
    dp_mesh = dims.mesh("dp")
    x, y = batch()
    if dp_mesh is not None:
        n, r = dp_mesh.size(), dp_mesh.get_local_rank()
        x, y = x.chunk(n)[r], y.chunk(n)[r]
    pp_mesh = dims.mesh("pp")
    pipe = build_pipeline(
        model,
        pp_mesh,
        schedule="1F1B",
        microbatch_size=1,
        local_batch_size=x.shape[0],
        loss_fn=cross_entropy,
        device=torch.device("cpu"),
    )
    full = ref.state_dict()
    for part in pipe.model_parts:
        part.to_empty(device="cpu")
        part.load_state_dict({k: v for k, v in full.items() if k in part.state_dict()})
        if dp_mesh is not None:
            apply_fsdp(part, dims.mesh("fsdp"), pp_enabled=True)
    params = [p for part in pipe.model_parts for p in part.parameters()]
    opt = build_optimizer(
        case.optimizer, params, pipeline_group=pp_mesh.get_group(), modules=pipe.model_parts
    )
    losses, norms = [], []
    for _ in range(case.steps):
        loss = broadcast_pipeline_loss(pipe.step(x, y), pp_mesh, torch.device("cpu"))
        norms.append(clip_grad_norm_(params, MAX_NORM, pp_mesh=pp_mesh).item())
        opt.step()
        opt.zero_grad()
        losses.append(dist_mean(loss, dp_mesh))
    mine = {k: v for part in pipe.model_parts for k, v in state_vector(part).items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return {
        "losses": losses,
        "norms": norms,
        "initial": state_vector(ref),
        "params": {k: v for d in gathered for k, v in d.items()},
        "tied": shared_names(ref),
        **({"muon_paths": dict(opt.paths)} if hasattr(opt, "paths") else {}),
    }


def run_case(case: Case) -> dict:
    from torch.distributed.tensor import DTensor

    if case.pp > 1:
        return run_pp_case(case)

    from titan_core.config import ConfigError
    from titan_core.protocols import TPPlan
    from titan_parallel import (
        ActivationCheckpoint,
        Compile,
        Parallelism,
        clip_grad_norm_,
        dist_mean,
        init_weights_exact,
        loss_context,
        parallelize,
    )

    cfg = Parallelism(
        data_parallel_shard_degree=case.dp_shard,
        data_parallel_replicate_degree=case.dp_replicate,
        tensor_parallel_degree=case.tp,
        enable_sequence_parallel=case.sp,
        disable_loss_parallel=not case.loss_parallel,
        fsdp_reshard_after_forward=case.reshard,
    )
    dims = cfg.build_parallel_dims(dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = MODELS[case.model]()
    plan = None
    if case.extra.get("plan") == "tied_output_left_whole":
        # The tied embedding split by vocabulary, its other holder (the output) not split.
        full = model.tp_plan()
        plan = TPPlan(
            root={"wte": "embedding"}, block=full.block, divisible_by_tp=full.divisible_by_tp
        )
    try:
        parallelize(
            model,
            dims,
            plan,
            parallelism=cfg,
            ac=ActivationCheckpoint(mode=case.ac, selective_ac_option=case.ac_option),
            compile=Compile(enable=case.compile, backend=case.compile_backend),
            param_dtype=getattr(torch, case.param_dtype),
            cpu_offload=case.cpu_offload,
        )
    except ConfigError as e:
        # Refused before anything changed: no parameter split, no module wrapped.
        untouched = type(model) is MODELS[case.model] and not any(
            isinstance(p, DTensor) for p in model.parameters()
        )
        return {"rejected": str(e), "untouched": untouched, "tied": shared_names(model)}
    model.to_empty(device="cpu")
    init_weights_exact(model, SEED)
    initial = state_vector(model)
    opt = build_optimizer(case.optimizer, model.parameters(), modules=[model])
    x, y = batch()
    dp_mesh = dims.mesh("dp")
    if dp_mesh is not None:  # each data-parallel rank takes its slice of the global batch
        n, r = dp_mesh.size(), dp_mesh.get_local_rank()
        x, y = x.chunk(n)[r], y.chunk(n)[r]
    losses, norms = [], []
    t0 = time.perf_counter()
    for _ in range(case.steps):
        with loss_context(dims, cfg):
            loss = cross_entropy(model(x), y)
            loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(dist_mean(loss, dp_mesh))
    out = {
        "losses": losses,
        "norms": norms,
        "initial": initial,
        "params": state_vector(model),
        "seconds": time.perf_counter() - t0,
        "tied": shared_names(model),
    }
    if case.extra.get("memory"):
        out["memory"] = local_bytes(model, opt)
    if hasattr(opt, "paths"):  # Muon: where its matrices were orthogonalised
        out["muon_paths"] = dict(opt.paths)
    return out


def local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (after a step, so
    the state exists; gradients are recreated by one more backward)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    x, y = batch()
    cross_entropy(model(x[:1]), y[:1]).backward()
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(
        nbytes(v)
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optim": states}


def run_naive_case(case: Case) -> dict:
    """The case with optimizer statistics taken on each rank's local shard only (what an
    optimizer unaware of sharding computes); for Muon, each shard orthogonalised alone."""
    from titan_parallel import muon, ranger21

    if case.optimizer.startswith("muon"):
        saved_split = muon.matrix_split
        muon.matrix_split = lambda p: []
        try:
            return run_case(case)
        finally:
            muon.matrix_split = saved_split
    saved = ranger21.row_sums_groups, ranger21.total_sums_groups
    ranger21.row_sums_groups = ranger21.total_sums_groups = lambda t: ()
    try:
        return run_case(case)
    finally:
        ranger21.row_sums_groups, ranger21.total_sums_groups = saved


def _worker(rank: int, world: int, init_file: str, cases: list, out_file: str, runner=None) -> None:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import titan_parallel  # noqa: F401  (timed on its own: it dominates start-up)

    results = {"_startup_seconds": time.perf_counter() - t0}
    for case in cases:
        t0 = time.perf_counter()
        try:
            if runner is not None:
                results[case.name] = runner(case)
            elif case.extra.get("naive"):
                results[case.name] = run_naive_case(case)
            else:
                results[case.name] = run_case(case)
            results[case.name]["total_seconds"] = time.perf_counter() - t0
        except Exception:  # recorded and compared by the test, which shows the traceback
            results[case.name] = {"error": traceback.format_exc()}
        dist.barrier()
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


class Launched:
    """Ranks started by `start_cases`, running in the background until `results()`."""

    def __init__(self, world: int, cases: list, timeout: float, runner=None):
        self._tmp = tempfile.TemporaryDirectory()
        self.world, self.out_file = world, os.path.join(self._tmp.name, "results.pt")
        self.deadline = time.monotonic() + timeout
        self.ctx = mp.start_processes(
            _worker,
            args=(world, os.path.join(self._tmp.name, "init"), cases, self.out_file, runner),
            nprocs=world,
            join=False,
            start_method="spawn",
        )

    def results(self) -> dict:
        try:
            while not self.ctx.join(timeout=2):
                if time.monotonic() > self.deadline:
                    for p in self.ctx.processes:
                        p.kill()
                    raise TimeoutError(f"the {self.world}-rank cases did not finish in time")
            return torch.load(self.out_file, weights_only=False)
        finally:
            self._tmp.cleanup()


def start_cases(world: int, cases: list, timeout: float = 600.0, runner=None) -> Launched:
    """Start `world` ranks that run `cases`; collect with `.results()` (rank 0's results).
    `runner(case) -> dict` runs one case (a module-level function); default `run_case`."""
    return Launched(world, cases, timeout, runner)


def run_cases(world: int, cases: list[Case], timeout: float = 600.0) -> dict:
    return start_cases(world, cases, timeout).results()
