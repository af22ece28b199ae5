"""The trainer's parallel runtime (`titan_trainer.parallel`) on real gloo process groups,
against one process. Four ranks start once and run every case:

- a Llama 3.2 1B-shaped model (the `1B` flavor with small dims: tied embeddings, grouped-query
  attention, Llama 3.2 rope scaling) under FSDP 4, FSDP 2 x TP 2, TP 4, HSDP 2 x 2 and
  CP 2 x FSDP 2;
- the same model under all-to-all context parallel (each rank attends over the whole sequence
  with a share of the heads): CP 2 x FSDP 2, CP 4 and CP 2 x TP 2;
- a third-party model (nothing of ours; its positional table is a buffer named `pos`) under
  CP 2 x FSDP 2, which finds its sequence buffers through `cp_buffers()`;
- the training step and validation with every tensor handed to a collective checked to be
  on the training device (`device_check.py`), and the check shown to catch a host tensor;
- block-causal attention over packed documents (`document_start_id`: the runtime gives the
  model `document_ids`) under FSDP 2 x TP 2, under pipeline parallel 2 x FSDP 2, whose
  second stage gets the ids with each microbatch, and under all-to-all context parallel (CP 2 x
  FSDP 2, CP 4, CP 2 x TP 2, CP 2 x PP 2), where documents span the ranks' pieces of the
  sequence;
- [[optimizer.param_groups]] under Muon on FSDP 4 with activation checkpointing (its wrapper
  prefixes in the names) and on pipeline stages 2 x FSDP 2: every parameter lands in the group
  one process gives it, and a training step runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

SEED, STEPS, BATCH, SEQ, DIM = 3, 5, 4, 16, 32
BOS = 1  # starts each document of the packed batches of the block-causal cases

LAYOUTS = {
    "fsdp4": dict(data_parallel_shard_degree=4),
    "fsdp2_tp2": dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
    "tp4": dict(data_parallel_shard_degree=1, tensor_parallel_degree=4),
    "hsdp2x2": dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2),
    "cp2_fsdp2": dict(
        data_parallel_shard_degree=2, context_parallel_degree=2, context_parallel_style="ring"
    ),
    "cp2_fsdp2_alltoall": dict(
        data_parallel_shard_degree=2, context_parallel_degree=2, context_parallel_style="alltoall"
    ),
    "cp4_alltoall": dict(
        data_parallel_shard_degree=1, context_parallel_degree=4, context_parallel_style="alltoall"
    ),
    "cp2_tp2_alltoall": dict(
        data_parallel_shard_degree=1,
        context_parallel_degree=2,
        tensor_parallel_degree=2,
        context_parallel_style="alltoall",
    ),
}
GROUP_LAYOUTS = {
    "fsdp4_ac": dict(data_parallel_shard_degree=4),
    "pp2_fsdp2": dict(data_parallel_shard_degree=2, pipeline_parallel_degree=2),
}
BLOCK_CAUSAL_LAYOUTS = {
    "fsdp2_tp2": LAYOUTS["fsdp2_tp2"],
    "pp2_fsdp2": dict(data_parallel_shard_degree=2, pipeline_parallel_degree=2),
    "cp2_fsdp2_alltoall": LAYOUTS["cp2_fsdp2_alltoall"],
    "cp4_alltoall": LAYOUTS["cp4_alltoall"],
    "cp2_tp2_alltoall": LAYOUTS["cp2_tp2_alltoall"],
    "cp2_pp2_alltoall": dict(
        data_parallel_shard_degree=1,
        context_parallel_degree=2,
        pipeline_parallel_degree=2,
        context_parallel_style="alltoall",
    ),
    # The ring with documents: positions dealt by the documents' work, each pair of chunks
    # under its own mask (titan_parallel.document_ring).
    "cp2_fsdp2_ring": LAYOUTS["cp2_fsdp2"],
    "cp4_ring": dict(
        data_parallel_shard_degree=1, context_parallel_degree=4, context_parallel_style="ring"
    ),
    "cp2_tp2_ring": dict(
        data_parallel_shard_degree=1,
        context_parallel_degree=2,
        tensor_parallel_degree=2,
        context_parallel_style="ring",
    ),
    "cp2_pp2_ring": dict(
        data_parallel_shard_degree=1,
        context_parallel_degree=2,
        pipeline_parallel_degree=2,
        context_parallel_style="ring",
    ),
}
# How each layout computes the mask (`block_causal_impl`), against the one-process dense mask:
# varlen under TP (each rank cuts its own heads by the same cu_seqlens), dense under PP; under
# all-to-all CP the mask covers the whole sequence, which every rank's attention sees.
BLOCK_CAUSAL_IMPL = {
    "fsdp2_tp2": "varlen",
    "pp2_fsdp2": "dense",
    "cp2_fsdp2_alltoall": "dense",
    "cp4_alltoall": "varlen",
    "cp2_tp2_alltoall": "varlen",
    "cp2_pp2_alltoall": "dense",
    # The ring builds its own masks; the model's is never asked for.
    "cp2_fsdp2_ring": "varlen",
    "cp4_ring": "varlen",
    "cp2_tp2_ring": "varlen",
    "cp2_pp2_ring": "varlen",  # made for its ids (each microbatch's rows), not attended under
}


# ----------------------------------------------------------------------------- models


def llama_1b_shaped(vocab: int = 256) -> nn.Module:
    from titan_models.llama3 import Transformer, llama3_flavors

    args = dataclasses.replace(
        llama3_flavors["1B"],  # tied embeddings, ffn multiplier, Llama 3.2 rope scaling
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        multiple_of=32,
        vocab_size=vocab,
        max_seq_len=SEQ,
    )
    assert args.tie_word_embeddings
    return Transformer(args)


class ThirdPartyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, 4, DIM // 4).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, DIM))


class ThirdPartyLM(nn.Module):
    """Someone else's model: its own names, a sinusoidal table `pos` [seq, dim]."""

    pre_blocks = ("embed",)
    post_blocks = ("head",)

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.register_buffer("pos", torch.zeros(SEQ, DIM), persistent=False)
        self.layers = nn.ModuleDict({str(i): ThirdPartyBlock() for i in range(2)})
        self.head = nn.Linear(DIM, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.layers.values():
            h = block(h)
        return self.head(h)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.1)
        t = torch.arange(SEQ, dtype=torch.float32)[:, None]
        freq = torch.exp(-math.log(100.0) * torch.arange(0, DIM, 2) / DIM)
        pos = torch.cat([torch.sin(t * freq), torch.cos(t * freq)], dim=-1)
        self.pos = pos.to(buffer_device or self.pos.device)

    def cp_buffers(self) -> dict[str, int]:
        return {"pos": 0}

    def tp_plan(self):
        raise NotImplementedError("this model runs without tensor parallel")

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def llama_untied(vocab: int = 256) -> nn.Module:
    """The same without tied embeddings: pipeline stages cannot share a weight."""
    from titan_models.llama3 import Transformer

    args = dataclasses.replace(llama_1b_shaped(vocab).args, tie_word_embeddings=False)
    return Transformer(args)


MODELS = {
    "llama_1b_shaped": llama_1b_shaped,
    "third_party": ThirdPartyLM,
    "llama_untied": llama_untied,
}


# ----------------------------------------------------------------------------- one process


def job_config(**parallelism):
    from titan_trainer.config import JobConfig

    cfg = JobConfig()
    cfg.training.seq_len = SEQ
    cfg.training.mixed_precision_param = "float32"
    cfg.optimizer.lr = 1e-2
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg


def batch(vocab: int = 256, documents: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens; with `documents`, packed documents of 3 to 7 tokens, each from BOS."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(2, vocab, (BATCH, SEQ + 1), generator=g)
    if documents:
        for row in tokens:
            at = int(torch.randint(0, 4, (1,), generator=g))
            while at < SEQ + 1:
                row[at] = BOS
                at += int(torch.randint(3, 8, (1,), generator=g))
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def document_kwargs(inputs: torch.Tensor, block_causal: bool) -> dict:
    return {"document_ids": (inputs == BOS).cumsum(-1)} if block_causal else {}


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def shared_names(module: nn.Module) -> list[list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(g for g in names.values() if len(g) > 1)


def reference(model_name: str, block_causal: bool = False, documents: bool | None = None) -> dict:
    from titan_trainer.optimizer import build_optimizer
    from titan_trainer.train import cross_entropy_loss

    cfg = job_config()
    with torch.device("meta"):
        model = MODELS[model_name]()
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights(buffer_device=torch.device("cpu"))
    initial = full_state(model)
    opt = build_optimizer([model], cfg.optimizer)
    inputs, labels = batch(documents=block_causal if documents is None else documents)
    kwargs = document_kwargs(inputs, block_causal)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = cross_entropy_loss(model(inputs, **kwargs), labels)
        loss.backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)))
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():  # validation's loss on the trained weights, the same batch
        evaluated = cross_entropy_loss(model(inputs, **kwargs), labels).item()
    return {
        "losses": losses,
        "evaluated": evaluated,
        "norms": norms,
        "initial": initial,
        "params": full_state(model),
        "tied": shared_names(model),
    }


# ----------------------------------------------------------------------------- the ranks


def _runtime(cfg, world: int):
    from titan_core import ParallelDims
    from titan_trainer.runtime import ParallelRuntime
    from titan_trainer.train import cross_entropy_loss

    dims = cfg.parallelism.build_parallel_dims(world)
    dims.build_mesh("cpu")
    cpu = torch.device("cpu")
    assert isinstance(dims, ParallelDims)
    return ParallelRuntime.of(cfg, dims, cpu, torch.float32, SEED, cross_entropy_loss)


def train_case(world: int, model_name: str, layout: str, block_causal: bool = False) -> dict:
    from titan_trainer.optimizer import build_optimizer

    cfg = job_config(**(BLOCK_CAUSAL_LAYOUTS if block_causal else LAYOUTS)[layout])
    runtime = _runtime(cfg, world)
    cfg.training.local_batch_size = BATCH // runtime.dims.dp_degree  # pipeline microbatches
    if block_causal:
        runtime.document_start_id = BOS
    with torch.device("meta"):
        model = MODELS[model_name]()
    if block_causal:
        model.block_causal_impl = BLOCK_CAUSAL_IMPL[layout]
    (part,) = runtime.parallelize(model)
    runtime.materialize([part])
    runtime.init_weights([part])
    initial = full_state(part)
    opt = build_optimizer([part], cfg.optimizer)
    inputs, labels = batch(documents=block_causal)
    dp = runtime.dims.mesh("dp")
    if dp is not None:  # each data-parallel rank takes its share of the global batch
        inputs = inputs.chunk(dp.size())[dp.get_local_rank()]
        labels = labels.chunk(dp.size())[dp.get_local_rank()]
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = runtime.forward_backward([part], inputs, labels, scale=1.0)
        norms.append(runtime.clip_grad_norm([part], cfg.training.max_norm))
        opt.step()
        losses.append(runtime.reduce_loss(loss))
    evaluated = None
    if block_causal:
        # Validation's forward (the runner's eval_loss: the same context-parallel sharding
        # and document masks, the pipeline's forward-only schedule), summed over the ranks as
        # the trainer's validator sums it.
        loss_sum, tokens = runtime.reduce_sum(
            torch.stack(runtime.eval_loss([part], inputs, labels))
        ).tolist()
        evaluated = loss_sum / tokens
    return {
        "losses": losses,
        "evaluated": evaluated,
        "norms": norms,
        "initial": initial,
        "params": full_state(part),
        "tied": shared_names(part),
    }


def device_check_case(world: int) -> dict:
    """Two training steps and a validation on FSDP 2 x TP 2, every collective checked."""
    from device_check import CollectiveDeviceCheck

    from titan_core import plugins, resolve
    from titan_trainer.guards import StepGuard
    from titan_trainer.metrics import StepTimer
    from titan_trainer.optimizer import build_optimizer
    from titan_trainer.train import train_step
    from titan_trainer.validate import Validator

    cfg = job_config(**LAYOUTS["fsdp2_tp2"])
    cfg.validation.enable, cfg.validation.steps, cfg.validation.local_batch_size = True, 2, 2
    runtime = _runtime(cfg, world)
    data = resolve(plugins.DATA, cfg.training.data_plugin)
    tokenizer = data.build_tokenizer("byte")
    with torch.device("meta"):
        model = llama_1b_shaped(vocab=320)  # the byte vocabulary, padded as the trainer does
    parts = runtime.parallelize(model)
    runtime.materialize(parts)
    runtime.init_weights(parts)
    opt = build_optimizer(parts, cfg.optimizer)
    dp = runtime.dims.mesh("dp")
    dp_rank, dp_world = dp.get_local_rank(), dp.size()
    loader = data.build_dataloader(
        dataset="pydocs",
        dataset_path=None,
        tokenizer=tokenizer,
        seq_len=SEQ,
        batch_size=2,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
    )
    validator = Validator(cfg.validation, data, "titan", tokenizer, dp_rank, dp_world, SEQ)
    batches = iter(loader)
    with CollectiveDeviceCheck() as check:
        losses = [
            train_step(runtime, parts, opt, batches, 1, StepTimer(), cfg, StepGuard(opt), step)[0]
            for step in (1, 2)
        ]
        val_loss = validator.run(runtime, parts)
    # The pattern validation used to have: a flag made without device= and all-reduced.
    with CollectiveDeviceCheck() as control:
        more = torch.tensor([1])
        dist.all_reduce(more, op=dist.ReduceOp.MIN)
    return {
        "violations": check.violations,
        "collectives": check.collectives,
        "control": control.violations,
        "losses": losses,
        "val_loss": val_loss,
    }


def muon_groups_config(**parallelism):
    from titan_trainer.param_groups import ParamGroup

    cfg = job_config(**parallelism)
    cfg.optimizer.name = "Muon"
    cfg.optimizer.param_groups = [
        ParamGroup(params="norm", weight_decay=0.0),
        ParamGroup(params=r"^layers\.0\.", lr=1e-4, beta2=0.9),
        ParamGroup(params="feed_forward", muon=False),
    ]
    return cfg


def grouping(optimizer, parts) -> dict[str, tuple]:
    """Parameter name (as the model gives it) -> the values of its optimizer group."""
    from titan_core.init import canonical_name

    names = {id(p): canonical_name(n) for part in parts for n, p in part.named_parameters()}
    return {
        names[id(p)]: (g["lr"], g["weight_decay"], g["betas"], g["use_muon"])
        for g in optimizer.param_groups
        for p in g["params"]
    }


def reference_grouping() -> dict[str, tuple]:
    from titan_trainer.optimizer import build_optimizer

    with torch.device("meta"):
        model = llama_untied()
    model.to_empty(device="cpu")
    return grouping(build_optimizer([model], muon_groups_config().optimizer), [model])


def param_groups_case(world: int, layout: str) -> dict:
    from titan_trainer.optimizer import build_optimizer

    cfg = muon_groups_config(**GROUP_LAYOUTS[layout])
    cfg.activation_checkpoint.mode = "full"  # names inside it gain _checkpoint_wrapped_module
    runtime = _runtime(cfg, world)
    cfg.training.local_batch_size = BATCH // runtime.dims.dp_degree
    with torch.device("meta"):
        model = llama_untied()
    parts = runtime.parallelize(model)
    runtime.materialize(parts)
    runtime.init_weights(parts)
    wrapped = [n for part in parts for n, _ in part.named_parameters() if "_checkpoint" in n]
    opt = build_optimizer(parts, cfg.optimizer, dims=runtime.dims)
    inputs, labels = batch()
    dp = runtime.dims.mesh("dp")
    inputs, labels = (t.chunk(dp.size())[dp.get_local_rank()] for t in (inputs, labels))
    loss = runtime.reduce_loss(runtime.forward_backward(parts, inputs, labels, scale=1.0))
    opt.step()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, grouping(opt, parts))
    return {
        "grouping": {k: v for mine in everyone for k, v in mine.items()},
        "wrapped": wrapped,
        "loss": float(loss),
    }


def _cases(world: int) -> dict:
    cases = {
        f"llama_1b_shaped_{layout}": (train_case, (world, "llama_1b_shaped", layout))
        for layout in LAYOUTS
    }
    cases["third_party_cp2_fsdp2"] = (train_case, (world, "third_party", "cp2_fsdp2"))
    for layout in BLOCK_CAUSAL_LAYOUTS:
        cases[f"block_causal_{layout}"] = (train_case, (world, "llama_untied", layout, True))
    cases["device_check"] = (device_check_case, (world,))
    cases["host_memory"] = (host_memory_case, (world,))
    cases["stop_agreement"] = (stop_agreement_case, (world,))
    for layout in GROUP_LAYOUTS:
        cases[f"param_groups_{layout}"] = (param_groups_case, (world, layout))
    return cases


def host_memory_case(world: int) -> dict:
    """The start-up memory check's host sum: every rank's need, gathered from the ranks on
    this host (all four here), rank r needing r + 1 GiB."""
    from titan_trainer.memory_check import RankNeed, host_needs

    need = RankNeed(state=(dist.get_rank() + 1) * 2**30, activations=None)
    return {"needs": [n.state for n in host_needs(need, torch.device("cpu"))]}


def stop_agreement_case(world: int) -> dict:
    """Six steps of the train loop's stop agreement; rank 1 alone is asked to stop during step
    3 (its flag stays up, as a SIGTERM's does): the step after which each rank stops."""
    from titan_trainer.stopping import StopAgreement

    agreement = StopAgreement(world)
    decisions = [agreement.poll(dist.get_rank() == 1 and step >= 3) for step in range(1, 7)]
    agreement.close(after_error=False)
    stops = [step for step, stop in enumerate(decisions, 1) if stop]
    every = [None] * world
    dist.all_gather_object(every, stops)
    return {"stops_after": every}


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, (fn, args) in _cases(world).items():
        start = time.perf_counter()
        try:
            results[name] = fn(*args)
        except Exception:  # compared by the tests, which show the traceback
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.perf_counter() - start
        dist.barrier()
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched():
    world = 4
    # forkserver: one clean server imports torch and the trainer once and forks the ranks, so
    # they skip most of the import cost without inheriting this process's threads.
    mp.set_forkserver_preload(["device_check", "titan_trainer.train", "titan_models.llama3"])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        ctx = mp.start_processes(
            _worker,
            args=(world, os.path.join(tmp, "init"), out),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        try:
            yield ctx, out
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


@pytest.fixture(scope="module")
def refs(launched) -> dict:
    # Computed here while the ranks start up.
    refs = {name: reference(name) for name in MODELS if name != "llama_untied"}
    refs["block_causal"] = reference("llama_untied", block_causal=True)
    refs["causal_on_documents"] = reference("llama_untied", block_causal=False, documents=True)
    refs["grouping"] = reference_grouping()
    return refs


@pytest.fixture(scope="module")
def results(launched, refs) -> dict:
    ctx, out = launched
    deadline = time.monotonic() + 600
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            raise TimeoutError("the 4 ranks did not finish in 600 s")
    found = torch.load(out, weights_only=False)
    print({name: f"{r['seconds']:.1f}s" for name, r in found.items()})
    return found


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _check(got: dict, ref: dict) -> None:
    assert "error" not in got, got["error"]
    stage = set(got["initial"]) < set(ref["initial"])  # a pipeline stage holds some weights
    if stage:
        ref = {
            **ref,
            "initial": {k: v for k, v in ref["initial"].items() if k in got["initial"]},
            "params": {k: v for k, v in ref["params"].items() if k in got["params"]},
            "tied": [],
        }
        got = {**got, "tied": []}
    # One weight for the embedding and the output projection, as in one process.
    assert got["tied"] == ref["tied"]
    # Exact initialisation: each rank's shard is cut from the tensor one process draws.
    for name, value in ref["initial"].items():
        assert torch.equal(got["initial"][name], value), name
    for step in range(STEPS):
        # Same weights and data; only the order of fp32 sums differs (sharded matmuls,
        # reduce-scatter, ring attention) and, after a step, Adam's division by sqrt(v)
        # amplifies that for near-zero gradients. Measured below 2e-5.
        assert _rel(got["losses"][step], ref["losses"][step]) < 1e-4, (got["losses"], ref["losses"])
        assert _rel(got["norms"][step], ref["norms"][step]) < 1e-4, (got["norms"], ref["norms"])
    # A missing or doubled gradient (an untied copy, a missed reduction) moves this to ~1e-1.
    diff = sum((got["params"][k] - v).pow(2).sum() for k, v in ref["params"].items()).sqrt()
    size = sum(v.pow(2).sum() for v in ref["params"].values()).sqrt()
    assert diff / size < 1e-4, float(diff / size)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_1b_shaped_with_tied_embeddings_trains_like_one_process(layout, results, refs):
    _check(results[f"llama_1b_shaped_{layout}"], refs["llama_1b_shaped"])
    assert refs["llama_1b_shaped"]["tied"] == [["tok_embeddings.weight", "output.weight"]]


def test_third_party_model_under_context_parallel_trains_like_one_process(results, refs):
    _check(results["third_party_cp2_fsdp2"], refs["third_party"])


@pytest.mark.parametrize("layout", list(BLOCK_CAUSAL_LAYOUTS))
def test_block_causal_attention_trains_like_one_process(layout, results, refs):
    _check(results[f"block_causal_{layout}"], refs["block_causal"])
    # ... and validates like one process (the same tolerance as the training losses).
    got, ref = results[f"block_causal_{layout}"]["evaluated"], refs["block_causal"]["evaluated"]
    assert _rel(got, ref) < 1e-4, (got, ref)
    # The mask matters on this batch: plain causal attention trains to other losses, by far
    # more than the tolerance above.
    causal, block = refs["causal_on_documents"]["losses"], refs["block_causal"]["losses"]
    assert max(_rel(c, b) for c, b in zip(causal, block)) > 5e-3, (causal, block)


def test_training_and_validation_hand_collectives_only_device_tensors(results):
    got = results["device_check"]
    assert "error" not in got, got["error"]
    assert got["violations"] == []
    # FSDP, TP, the loss and norm reductions and validation's stop flag all went through it.
    assert got["collectives"] > 20, got["collectives"]
    assert all(math.isfinite(x) for x in got["losses"]) and math.isfinite(got["val_loss"])
    # The check sees what NCCL would refuse: the flag the validation loop used to all-reduce.
    (control,) = got["control"]
    assert "torch.distributed.all_reduce is handed a host tensor (1,)" in control


def test_the_memory_check_adds_up_the_needs_of_every_rank_on_the_host(results):
    got = results["host_memory"]
    assert "error" not in got, got.get("error")
    assert got["needs"] == [r * 2**30 for r in range(1, 5)]


def test_a_stop_asked_of_one_rank_stops_every_rank_after_the_same_step(results):
    # Rank 1's flag goes up in step 3; every rank reads it at the end of step 4 (a step later:
    # the all-reduce was not waited for) and stops there, and at every later step.
    assert "error" not in results["stop_agreement"], results["stop_agreement"]
    assert results["stop_agreement"]["stops_after"] == [[4, 5, 6]] * 4  # ranks 0 to 3


@pytest.mark.parametrize("layout", list(GROUP_LAYOUTS))
def test_param_groups_under_fsdp_and_pipeline_stages_group_like_one_process(layout, results, refs):
    got = results[f"param_groups_{layout}"]
    assert "error" not in got, got["error"]
    assert got["wrapped"], "activation checkpointing did not wrap the blocks"
    assert got["grouping"] == refs["grouping"]
    ref = refs["grouping"]
    assert ref["layers.0.attention_norm.weight"] == (1e-2, 0.0, (0.9, 0.95), False)
    assert ref["layers.0.feed_forward.w1.weight"] == (1e-4, 0.1, (0.9, 0.9), True)
    assert ref["layers.1.feed_forward.w1.weight"] == (1e-2, 0.1, (0.9, 0.95), False)  # muon off
    assert ref["layers.1.attention.wq.weight"] == (1e-2, 0.1, (0.9, 0.95), True)
    assert (
        ref["output.weight"]
        == ref["tok_embeddings.weight"]
        == ref["layers.1.feed_forward.w1.weight"]
    )
    assert math.isfinite(got["loss"])
