"""Pipeline and context parallel on real gloo process groups, against a 1-process reference.

Starting processes costs most of the time on a small CPU machine, so there are two spawns
(2 and 4 ranks); each runs every case in one process group and writes a small report per
case, and the tests below assert on the reports. Every rank builds the same reference
(full model, full batch, one process) from the same seed and compares its own share.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.multiprocessing.spawn import ProcessException

from titan_core import ParallelDims
from titan_core.config import ConfigError
from titan_parallel.context_parallel import cp_context, cp_unshard
from titan_parallel.pipeline import broadcast_pipeline_loss, build_pipeline, pp_total_norm

SCHEDULE_NAMES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 16, 2, 6, 16


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.ffn_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        # -1 heads: with tensor parallel each rank holds a share of them.
        q, k, v = (
            w(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class ToyLM(nn.Module):
    """ParallelizableModel-shaped: pre-blocks, a ModuleDict of blocks, post-blocks, and a
    positional table buffer that context parallel shards along with the tokens."""

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.register_buffer("pos", torch.zeros(SEQ, DIM))
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.3)
        position = torch.arange(SEQ, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(100.0) * torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
        self.pos[:, 0::2] = torch.sin(position * freq)
        self.pos[:, 1::2] = torch.cos(position * freq)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference(
    batch: int, seed: int = 1
) -> tuple[ToyLM, torch.Tensor, torch.Tensor, float, dict[str, torch.Tensor]]:
    """Model, full batch, its loss and gradients, all in this one process."""
    torch.manual_seed(0)
    model = ToyLM()
    with torch.no_grad():
        model.init_weights()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    loss = loss_fn(model(tokens), labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return model, tokens, labels, loss.item(), grads


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ----------------------------------------------------------------------------- pipeline cases


def _materialise(parts: list[nn.Module], ref: ToyLM) -> None:
    state = ref.state_dict()
    for part in parts:
        part.to_empty(device="cpu")
        missing, unexpected = part.load_state_dict(
            {k: v for k, v in state.items() if k in part.state_dict()}
        )
        assert not missing and not unexpected, (missing, unexpected)


def _grad_report(parts: list[nn.Module], grads: dict[str, torch.Tensor]) -> dict:
    err, names = 0.0, []
    for part in parts:
        for name, p in part.named_parameters():
            err = max(err, (full(p.grad) - grads[name]).abs().max().item())
            names.append(name)
    return {"grad_err": err, "names": names}


def pp_case(ctx: dict, schedule: str, *, fsdp: bool = False, **kwargs) -> dict:

    world = ctx["world"]
    pp = world // 2 if fsdp else world
    dims = ParallelDims(world_size=world, pp=pp, dp_shard=world // pp)
    dims.build_mesh("cpu")
    local_batch = kwargs.pop("local_batch", 2 * pp)
    dp = dims.dp_degree
    ref, tokens, labels, ref_loss, grads = reference(local_batch * dp)
    with torch.device("meta"):
        meta_model = ToyLM()
    pipe = build_pipeline(
        meta_model,
        dims.mesh("pp"),
        schedule=schedule,
        microbatch_size=kwargs.pop("microbatch_size", 1),
        local_batch_size=local_batch,
        loss_fn=loss_fn,
        device=torch.device("cpu"),
        **kwargs,
    )
    _materialise(pipe.model_parts, ref)
    if fsdp:
        for part in pipe.model_parts:
            for block in part.layers.values():
                fully_shard(block, mesh=dims.mesh("fsdp"), reshard_after_forward=False)
            fully_shard(part, mesh=dims.mesh("fsdp"), reshard_after_forward=False)
    dp_rank = dims.mesh("dp").get_local_rank() if dims.dp_enabled else 0
    rows = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
    loss = pipe.step(tokens[rows], labels[rows])
    step_loss = broadcast_pipeline_loss(loss, dims.mesh("pp"), torch.device("cpu"))
    # The gradients of the training step, before the forward-only pass below.
    local_sq = sum(
        (full(p.grad) ** 2).sum() for part in pipe.model_parts for p in part.parameters()
    )
    norm = pp_total_norm(torch.as_tensor(local_sq).sqrt(), dims.mesh("pp"))
    ref_norm = torch.stack([g.norm() for g in grads.values()]).norm().item()
    local_max = max(
        full(p.grad).abs().max() for part in pipe.model_parts for p in part.parameters()
    )
    inf_norm = pp_total_norm(local_max, dims.mesh("pp"), norm_type=float("inf"))
    ref_inf = max(g.abs().max() for g in grads.values()).item()
    report = _grad_report(pipe.model_parts, grads)
    # Forward only (the same weights: no optimizer step): the microbatches' losses summed.
    # Where a rank holds two neighbouring stages (V schedules) it is refused on every rank.
    eval_refused = None
    try:
        summed = pipe.eval(tokens[rows], labels[rows])
    except ConfigError as e:
        eval_refused, summed = str(e), None
    eval_loss = broadcast_pipeline_loss(summed, dims.mesh("pp"), torch.device("cpu"))
    eval_loss /= pipe.n_microbatches
    if eval_refused is not None:
        eval_loss = torch.tensor(float("nan"))
    if fsdp:  # the reference loss is over the global batch: average the dp ranks' losses
        for value in (step_loss, eval_loss):
            dist.all_reduce(value, group=dims.mesh("dp").get_group())
            value /= dp
    report.update(
        loss_err=abs(step_loss.item() - ref_loss),
        eval_err=abs(eval_loss.item() - ref_loss),
        eval_refused=eval_refused,
        norm_err=max(abs(norm.item() - ref_norm), abs(inf_norm.item() - ref_inf)),
        stage_ids=pipe.stage_ids,
        has_first=pipe.has_first,
        has_last=pipe.has_last,
        all_names=sorted(grads),
    )
    return report


def pp_csv_case(ctx: dict, source: str) -> dict:
    """Write the compute-only CSV of a known schedule, then run it as a custom schedule."""

    dims = ParallelDims(world_size=ctx["world"], pp=ctx["world"])
    dims.build_mesh("cpu")
    path = Path(ctx["tmp"]) / f"{source}_{ctx['world']}.csv"
    with torch.device("meta"):
        known = build_pipeline(
            ToyLM(),
            dims.mesh("pp"),
            schedule=source,
            microbatch_size=1,
            local_batch_size=2 * ctx["world"],
            loss_fn=loss_fn,
            device=torch.device("cpu"),
        )
    if ctx["rank"] == 0:
        known.schedule._dump_csv(str(path), format="compute_only")
    dist.barrier()
    report = pp_case(ctx, "ignored-with-csv", csv_path=path)
    report["expected_stage_ids"] = known.stage_ids
    return report


def pp_error_case(ctx: dict, **kwargs) -> dict:
    """Build with an invalid combination and return the error message."""

    dims = ParallelDims(world_size=ctx["world"], pp=ctx["world"])
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = ToyLM()
    args = dict(
        microbatch_size=1,
        local_batch_size=2 * ctx["world"],
        loss_fn=loss_fn,
        device=torch.device("cpu"),
    )
    args.update(kwargs)
    try:
        build_pipeline(model, dims.mesh("pp"), **args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def pp_csv_with_comms_error_case(ctx: dict) -> dict:
    path = Path(ctx["tmp"]) / "with_comms.csv"
    if ctx["rank"] == 0:
        path.write_text("0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0\n")
    dist.barrier()
    return pp_error_case(ctx, csv_path=path)


# ----------------------------------------------------------------------------- context parallel cases


def cp_attention_case(ctx: dict, rotate: str, load_balance: bool) -> dict:
    """Ring attention on sequence shards vs full-sequence SDPA: output and q/k/v grads."""

    mesh = init_device_mesh("cpu", (ctx["world"],), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(3)
    q, k, v, g = (torch.randn(2, 4, 32, 8, generator=gen) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).detach()
    ql, kl, vl, gl = (t.detach().clone() for t in (q, k, v, g))
    with cp_context(
        mesh,
        [ql, kl, vl, gl],
        [2, 2, 2, 2],
        {ql, kl, vl, gl},
        rotate_method=rotate,
        load_balance=load_balance,
    ):
        for t in (ql, kl, vl):
            t.requires_grad_()
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(gl)
    local_len = ql.shape[2]
    outs = cp_unshard(
        mesh, [out.detach(), ql.grad, kl.grad, vl.grad], [2, 2, 2, 2], load_balance=load_balance
    )
    errs = [(a - b).abs().max().item() for a, b in zip(outs, [ref, q.grad, k.grad, v.grad])]
    return {"out_err": errs[0], "grad_err": max(errs[1:]), "local_len": local_len}


def cp_model_case(
    ctx: dict,
    rotate: str,
    load_balance: bool,
    *,
    dp_shard: int = 1,
    tp: int = 1,
    fsdp: bool = False,
) -> dict:
    """A training step of the toy model with the sequence split over cp ranks (optionally
    with FSDP over dp_shard x cp, or TP on the attention and MLP) vs the 1-process step."""

    world = ctx["world"]
    cp = world // (dp_shard * tp)
    dims = ParallelDims(world_size=world, dp_shard=dp_shard, cp=cp, tp=tp)
    dims.build_mesh("cpu")
    ref, tokens, labels, ref_loss, grads = reference(2 * dp_shard)
    model = ref  # the reference's weights, reused: grads were zeroed
    if tp > 1:
        plan = {
            "wq": ColwiseParallel(),
            "wk": ColwiseParallel(),
            "wv": ColwiseParallel(),
            "wo": RowwiseParallel(),
        }
        plan |= {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        for block in model.layers.values():
            parallelize_module(block, dims.mesh("tp"), plan)
    if fsdp:
        for block in model.layers.values():
            fully_shard(block, mesh=dims.mesh("fsdp"))
        fully_shard(model, mesh=dims.mesh("fsdp"))
    dp_rank = dims.mesh("dp").get_local_rank() if dims.dp_enabled else 0
    inputs, targets = (
        tokens[2 * dp_rank : 2 * dp_rank + 2].clone(),
        labels[2 * dp_rank : 2 * dp_rank + 2].clone(),
    )
    with cp_context(
        dims.mesh("cp"),
        [inputs, targets, model.pos],
        [1, 1, 0],
        {inputs, targets},
        rotate_method=rotate,
        load_balance=load_balance,
    ):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
    restored = bool(model.pos.shape[0] == SEQ)
    # Each cp rank's loss is the mean over its share of tokens (equal shares): average them.
    # FSDP's reduce-scatter averages gradients over dp_shard x cp; without it, do that here.
    step_loss = loss.detach().clone()
    dist.all_reduce(step_loss, group=dims.mesh("dp_cp").get_group())
    step_loss /= dims.degree("dp_cp")
    if not fsdp:
        for p in model.parameters():
            g = p.grad
            local = g.to_local() if hasattr(g, "to_local") else g
            dist.all_reduce(local, group=dims.mesh("cp").get_group())
            local /= cp
    err = max((full(p.grad) - grads[n]).abs().max().item() for n, p in model.named_parameters())
    return {
        "loss_err": abs(step_loss.item() - ref_loss),
        "grad_err": err,
        "local_len": inputs.shape[1],
        "restored": restored,
    }


# ----------------------------------------------------------------------------- the spawns


def cases(world: int) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for name in SCHEDULE_NAMES:
        # 2 x pp microbatches satisfies every schedule, V-shaped ones included.
        out[f"pp_{name}"] = (pp_case, (name,), {})
    if world == 2:
        out["pp_csv_ZBVZeroBubble"] = (pp_csv_case, ("ZBVZeroBubble",), {})
        out["pp_split_points"] = (
            pp_case,
            ("1F1B",),
            {
                "split_points": [
                    ["tok_embeddings", "layers.0"],
                    [f"layers.{i}" for i in range(1, 6)] + ["norm", "output"],
                ]
            },
        )
        out["pp_balanced_flops"] = (pp_case, ("GPipe",), {"balance": "flops", "seq_len": SEQ})
        out["pp_layers_per_stage_loop"] = (pp_case, ("LoopedBFS",), {"layers_per_stage": 2})
        out["pp_microbatch_size_2"] = (pp_case, ("1F1B",), {"microbatch_size": 2, "local_batch": 4})
        out["err_v_needs_microbatches"] = (
            pp_error_case,
            (),
            {"schedule": "DualPipeV", "local_batch_size": 2},
        )
        out["err_zbv_two_stages_per_rank"] = (
            pp_error_case,
            (),
            {"schedule": "ZBVZeroBubble", "layers_per_stage": 4, "local_batch_size": 8},
        )
        out["err_1f1b_microbatches"] = (
            pp_error_case,
            (),
            {"schedule": "1F1B", "local_batch_size": 1},
        )
        out["err_interleaved_rounds"] = (
            pp_error_case,
            (),
            {"schedule": "Interleaved1F1B", "local_batch_size": 5},
        )
        out["err_batch_split"] = (
            pp_error_case,
            (),
            {"schedule": "GPipe", "local_batch_size": 4, "microbatch_size": 3},
        )
        out["err_unknown_schedule"] = (pp_error_case, (), {"schedule": "ZeroBubbleV2"})
        out["err_layers_do_not_split"] = (
            pp_error_case,
            (),
            {"schedule": "1F1B", "layers_per_stage": 3},
        )
        out["err_single_stage_multi"] = (
            pp_error_case,
            (),
            {"schedule": "GPipe", "layers_per_stage": 2},
        )
        out["err_csv_with_comms"] = (pp_csv_with_comms_error_case, (), {})
        out["err_csv_missing"] = (pp_error_case, (), {"csv_path": "/nonexistent/schedule.csv"})
    else:
        out["pp_csv_Interleaved1F1B"] = (pp_csv_case, ("Interleaved1F1B",), {})
        for name in SCHEDULE_NAMES:
            out[f"pp2_fsdp2_{name}"] = (pp_case, (name,), {"fsdp": True})
    for rotate in ("allgather", "alltoall"):
        for lb in (True, False):
            out[f"cp_attention_{rotate}_{'lb' if lb else 'nolb'}"] = (
                cp_attention_case,
                (rotate, lb),
                {},
            )
    out["cp_model_allgather_lb"] = (cp_model_case, ("allgather", True), {})
    out["cp_model_alltoall_nolb"] = (cp_model_case, ("alltoall", False), {})
    if world == 2:
        out["cp_model_fsdp"] = (cp_model_case, ("alltoall", True), {"fsdp": True})
    else:
        out["cp2_fsdp2_model"] = (cp_model_case, ("allgather", True), {"dp_shard": 2, "fsdp": True})
        out["cp2_tp2_model"] = (cp_model_case, ("alltoall", True), {"tp": 2})
    return out


def _write(out_dir: str, rank: int, results: dict) -> None:
    # One file per rank rather than an object all-gather: the parent must be able to read
    # what every rank finished even when another rank died mid-collective.
    path = os.path.join(out_dir, f"results{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    ctx = {"rank": rank, "world": world, "tmp": out_dir}
    results: dict = {}
    for name, (fn, args, kwargs) in cases(world).items():
        start = time.perf_counter()
        try:
            report = fn(ctx, *args, **kwargs)
        except Exception:
            # The other ranks may now be waiting in a collective this rank will never join;
            # going on would misalign every later case, so record and stop this process.
            # The parent sees the non-zero exit and stops the other ranks at once.
            results[name] = {"exception": traceback.format_exc()}
            _write(out_dir, rank, results)
            raise
        report["seconds"] = time.perf_counter() - start
        results[name] = report
        _write(out_dir, rank, results)
    dist.destroy_process_group()


SPAWN_DEADLINE_S = 300.0


def _spawn(world: int, tmp: Path) -> dict[str, list[dict]]:
    # forkserver: one clean server process imports torch once and forks the ranks, so they
    # skip most of the import cost but never inherit this (multi-threaded) process's state;
    # a plain fork after other distributed tests ran in this process can deadlock.
    mp.set_forkserver_preload(
        ["torch.distributed.pipelining", "torch.distributed.fsdp", "titan_parallel"]
    )
    procs = mp.start_processes(
        _worker,
        args=(world, str(tmp / "init"), str(tmp)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline, stopped = time.monotonic() + SPAWN_DEADLINE_S, ""
    try:
        while not procs.join(timeout=2):
            if time.monotonic() > deadline:
                stopped = f"the {world} ranks did not finish within {SPAWN_DEADLINE_S:.0f} s"
                break
    except ProcessException as exc:  # a rank raised; join() has stopped the others
        stopped = f"rank {exc.error_index} raised (its own report has the traceback)"
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    per_rank = []
    for r in range(world):
        path = tmp / f"results{r}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    # Every case gets one report per rank; one a rank never finished says why.
    missing = {"exception": f"case not finished: {stopped or 'the rank exited early'}"}
    return {name: [ranks.get(name, missing) for ranks in per_rank] for name in cases(world)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    return {world: _spawn(world, tmp_path_factory.mktemp(f"world{world}")) for world in (2, 4)}


def _ok(reports: list[dict]) -> list[dict]:
    for r in reports:
        assert "exception" not in r, r["exception"]
    return reports


# ----------------------------------------------------------------------------- pipeline tests

# fp32 tolerances: the pipeline adds per-microbatch losses and gradients where the reference
# reduces over the whole batch at once, so only the summation order differs (~1e-7 relative
# on O(1) values); 1e-5 absolute leaves room for that and nothing else.
LOSS_TOL = GRAD_TOL = 1e-5


def _check_eval(r: dict, schedule: str) -> None:
    """The forward-only loss equals one process's, or, where one rank holds two neighbouring
    stages (the V schedules), every rank refuses it with the fix."""
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        assert r["eval_refused"] is not None, r
        assert f"does not run under the {schedule} pipeline schedule" in r["eval_refused"]
        assert (
            "use a schedule that keeps neighbouring stages on different ranks"
            in (r["eval_refused"])
        )
    else:
        assert r["eval_refused"] is None, r["eval_refused"]
        assert r["eval_err"] < LOSS_TOL


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_every_schedule_matches_single_process_loss_and_grads(results, world, schedule):
    reports = _ok(results[world][f"pp_{schedule}"])
    for r in reports:
        assert r["loss_err"] < LOSS_TOL
        _check_eval(r, schedule)  # Pipeline.eval: the forward-only schedule
        assert r["grad_err"] < GRAD_TOL
        assert r["norm_err"] < GRAD_TOL  # pp_total_norm == the whole model's 2- and inf-norms
    # Every parameter is owned by exactly one stage.
    owned = sorted(n for r in reports for n in r["names"])
    assert owned == reports[0]["all_names"]
    stages = sorted(s for r in reports for s in r["stage_ids"])
    per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    assert stages == list(range(world * per_rank))
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # V: rank 0 holds the first and the last stage
        assert reports[0]["has_first"] and reports[0]["has_last"]
        assert reports[0]["stage_ids"] == [0, 2 * world - 1]


@pytest.mark.parametrize("world,source", [(2, "ZBVZeroBubble"), (4, "Interleaved1F1B")])
def test_schedule_from_csv_matches_reference_and_infers_stage_placement(results, world, source):
    reports = _ok(results[world][f"pp_csv_{source}"])
    for r in reports:
        assert r["loss_err"] < LOSS_TOL and r["grad_err"] < GRAD_TOL
        assert r["stage_ids"] == r["expected_stage_ids"]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_pp2_with_fsdp2_matches_global_batch_reference(results, schedule):
    for r in _ok(results[4][f"pp2_fsdp2_{schedule}"]):
        assert r["loss_err"] < LOSS_TOL
        _check_eval(r, schedule)
        assert r["grad_err"] < GRAD_TOL
        assert r["norm_err"] < GRAD_TOL


@pytest.mark.parametrize(
    "case",
    ["pp_split_points", "pp_balanced_flops", "pp_layers_per_stage_loop", "pp_microbatch_size_2"],
)
def test_other_splits_and_microbatch_sizes_match_reference(results, case):
    reports = _ok(results[2][case])
    for r in reports:
        assert r["loss_err"] < LOSS_TOL and r["grad_err"] < GRAD_TOL
    if case == "pp_split_points":
        assert reports[0]["names"][:1] == ["tok_embeddings.weight"]
        assert not any(n.startswith("layers.1.") for n in reports[0]["names"])


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "err_v_needs_microbatches",
            "DualPipeV needs at least as many microbatches as stages: 2 < 4",
        ),
        ("err_zbv_two_stages_per_rank", "ZBVZeroBubble needs exactly 2 stages per rank"),
        ("err_1f1b_microbatches", "1F1B needs at least as many microbatches as stages: 1 < 2"),
        ("err_interleaved_rounds", "5 microbatches do not split into 2 equal rounds"),
        ("err_batch_split", "local_batch_size = 4 does not split into microbatches"),
        ("err_unknown_schedule", "'ZeroBubbleV2' is not a schedule"),
        ("err_layers_do_not_split", "pipeline_parallel_layers_per_stage = 3 does not divide"),
        ("err_single_stage_multi", "GPipe runs one stage per rank, but the split has 4 stages"),
        ("err_csv_missing", "/nonexistent/schedule.csv does not exist"),
        ("err_csv_with_comms", "contains communication actions"),
    ],
)
def test_invalid_pipeline_combinations_fail_up_front_with_a_clear_message(results, case, expected):
    for r in _ok(results[2][case]):
        assert r["error"] is not None and r["error"].startswith("ConfigError"), r["error"]
        assert expected in r["error"]


# ----------------------------------------------------------------------------- context parallel tests

# fp32 tolerances: ring attention merges per-block softmax results through log-sum-exp in
# fp32, a different summation order than one softmax over the whole row; errors stay at a
# few ulps of O(1) values, so 1e-5 absolute.
CP_TOL = 1e-5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("load_balance", [True, False])
def test_cp_attention_matches_full_sequence_sdpa(results, world, rotate, load_balance):
    for r in _ok(results[world][f"cp_attention_{rotate}_{'lb' if load_balance else 'nolb'}"]):
        assert r["local_len"] == 32 // world
        assert r["out_err"] < CP_TOL
        assert r["grad_err"] < CP_TOL


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["cp_model_allgather_lb", "cp_model_alltoall_nolb"])
def test_cp_model_step_matches_full_sequence_loss_and_grads(results, world, case):
    for r in _ok(results[world][case]):
        assert r["local_len"] == SEQ // world
        assert r["restored"]  # the positional table got its full length back
        assert r["loss_err"] < CP_TOL
        assert r["grad_err"] < CP_TOL


@pytest.mark.parametrize(
    "world,case", [(2, "cp_model_fsdp"), (4, "cp2_fsdp2_model"), (4, "cp2_tp2_model")]
)
def test_cp_composes_with_fsdp_and_tp(results, world, case):
    for r in _ok(results[world][case]):
        assert r["loss_err"] < CP_TOL
        assert r["grad_err"] < CP_TOL
