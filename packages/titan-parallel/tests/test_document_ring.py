"""Ring context parallel over packed documents (`titan_parallel.document_ring`) on real gloo
process groups, against block-causal attention over the whole sequence in one process: fp32
outputs and the gradients of q, k and v, at CP 4 and CP 2, on tricky packings (one document
over every chunk, length-1 documents, many documents in one chunk, documents that end exactly
at chunk borders, a log-normal mix), with grouped key/value heads, on the CPU flash kernel and
on the plain formulas other devices run. Four ranks start once and run every case.

Tolerance: each pair's softmax is merged by log-sum-exp, so sums run in another order than in
one process: 1e-5 absolute in fp32 (measured: below 1e-6)."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from titan_core import DocumentMask, HeadAttention
from titan_parallel import document_ring
from titan_parallel.document_ring import (
    apply_document_ring_cp,
    document_ring_scope,
    head_tail_imbalance,
    plan_document_ring,
)

WORLD, B, S, D = 4, 2, 48, 8
TOLERANCE = 1e-5


def ids_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) == S, lengths
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows)


def lognormal_ids(seed: int, batch: int = B, seq: int = S, mean: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            n = max(1, int(torch.empty(1).log_normal_(mean, 1.0, generator=g)))
            n = min(n, seq - total)
            lengths.append(n)
            total += n
        rows.append(lengths)
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])


PACKINGS = {
    "one_document_over_every_chunk": lambda: ids_of([[S], [S]]),
    "length_1_documents": lambda: ids_of([[1] * S, [1] * 20 + [28]]),
    "many_documents_in_one_chunk": lambda: ids_of([[1, 2, 1, 3, 1, 40], [44, 1, 1, 1, 1]]),
    # CP 4 cuts S into 8 chunks of 6 (CP 2 into 4 of 12): every document ends at a border.
    "documents_end_at_chunk_borders": lambda: ids_of([[6, 6, 12, 24], [12, 12, 12, 12]]),
    "lognormal_mix": lambda: lognormal_ids(3),
}


def dense_mask(ids: torch.Tensor) -> torch.Tensor:
    same = ids[:, :, None] == ids[:, None, :]
    return (same & torch.ones(S, S, dtype=torch.bool).tril())[:, None]


def whole_attention(q, k, v, mask):
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Layer(nn.Module, HeadAttention):
    def __init__(self, heads: int, kv: int) -> None:
        super().__init__()
        self.heads = (heads, kv)

    def attend(self, q, k, v, mask):
        return whole_attention(q, k, v, mask)

    def attention_heads(self) -> tuple[int, int]:
        return self.heads


def case(mesh, packing: str, heads: int, kv: int, plain: bool) -> dict:
    cp, rank = mesh.size(), mesh.get_local_rank()
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (heads, kv, kv))
    ids = PACKINGS[packing]()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = whole_attention(*ref, dense_mask(ids))
    (out * out.detach().sin()).sum().backward()

    plan = plan_document_ring(ids, cp, rank)
    mine = plan.positions(rank)
    layer = Layer(heads, kv)
    apply_document_ring_cp(layer, mesh)
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    document_ring._Kernel.plain = plain
    try:
        with document_ring_scope(plan):
            got = layer.attend(*local, None)
        (got * got.detach().sin()).sum().backward()
    finally:
        document_ring._Kernel.plain = False
    errors = {"out": (got - out[:, :, mine]).abs().max().item()}
    for name, m, r in zip("qkv", local, ref):
        errors[f"grad_{name}"] = (m.grad - r.grad[:, :, mine]).abs().max().item()
    return errors


class RowsMask(DocumentMask):
    """A model's mask for some rows of the batch (a pipeline's microbatch): only its ids."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.document_ids = ids


def rows_case(mesh, compiled: bool) -> dict:
    """The plan is made for the whole batch; a layer given rows 1.. of it (a microbatch) with
    their ids in the model's mask attends under those rows' masks. `compiled`: the layer's
    attend compiled (the ring runs eagerly inside)."""
    cp, rank = mesh.size(), mesh.get_local_rank()
    g = torch.Generator().manual_seed(5)
    batch = 3
    q, k, v = (torch.randn(batch, 4, S, D, generator=g) for _ in range(3))
    ids = torch.cat([PACKINGS["lognormal_mix"](), PACKINGS["many_documents_in_one_chunk"]()])[
        :batch
    ]
    rows = slice(1, batch)
    ref = [t[rows].clone().requires_grad_() for t in (q, k, v)]
    full = dense_mask(ids)
    out = whole_attention(*ref, full[rows])
    (out * out.detach().sin()).sum().backward()
    plan = plan_document_ring(ids, cp, rank)
    mine = plan.positions(rank)
    layer = Layer(4, 4)
    apply_document_ring_cp(layer, mesh)
    attend = torch.compile(layer.attend, backend="aot_eager") if compiled else layer.attend
    local = [t[rows][:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with document_ring_scope(plan):
        got = attend(*local, RowsMask(ids[rows]))
    (got * got.detach().sin()).sum().backward()
    errors = {"out": (got - out[:, :, mine]).abs().max().item()}
    for name, m, r in zip("qkv", local, ref):
        errors[f"grad_{name}"] = (m.grad - r.grad[:, :, mine]).abs().max().item()
    return errors


def sharding_case(mesh) -> dict:
    """`cp_context(style="ring", document_ids=...)`: the plan's positions kept, the model's
    table given back whole, `cp_unshard` puts the shares back in sequence order."""
    from titan_parallel.context_parallel import cp_context, cp_unshard

    cp, rank = mesh.size(), mesh.get_local_rank()
    ids = PACKINGS["lognormal_mix"]()
    tokens = torch.arange(B * S).view(B, S)
    table = torch.arange(S * 3, dtype=torch.float32).view(S, 3)
    inputs, whole_table = tokens.clone(), table.clone()
    mine = plan_document_ring(ids, cp, rank).positions(rank)
    with cp_context(mesh, [inputs, table], [1, 0], {inputs}, style="ring", document_ids=ids):
        inside = torch.equal(table, whole_table[mine])
    unshard = cp_unshard(mesh, [inputs], [1], style="ring", document_ids=ids)[0]
    return {
        "table_cut_inside": inside,
        "batch_kept_cut": torch.equal(inputs, tokens[:, mine]),
        "table_whole_after": torch.equal(table, whole_table),
        "unshard": torch.equal(unshard, tokens),
    }


CASES = {
    f"cp{cp}_{packing}_{kernel}": (cp, packing, heads, kv, kernel == "plain")
    for cp, heads, kv in ((4, 4, 2), (2, 4, 4))
    for packing in PACKINGS
    for kernel in ("cpu_flash", "plain")
}


def worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        4: init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))["cp"],
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"],
    }
    report = {}
    for name, (cp, *args) in CASES.items():
        try:
            report[name] = case(meshes[cp], *args)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    for name, compiled in (("rows", False), ("rows_compiled", True)):
        try:
            report[name] = rows_case(meshes[2], compiled)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    try:
        report["sharding"] = sharding_case(meshes[4])
    except Exception:
        report["sharding"] = {"error": traceback.format_exc()}
    queue.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports() -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=60)
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_the_document_ring_equals_block_causal_attention_in_one_process(reports, name):
    for rank in range(WORLD):
        errors = reports[rank][name]
        assert "error" not in errors, errors.get("error")
        assert max(errors.values()) < TOLERANCE, (rank, errors)


@pytest.mark.parametrize("name", ["rows", "rows_compiled"])
def test_a_microbatchs_rows_attend_under_their_own_documents(reports, name):
    for rank in range(WORLD):
        errors = reports[rank][name]
        assert "error" not in errors, errors.get("error")
        assert max(errors.values()) < TOLERANCE, (rank, errors)


def test_cp_context_keeps_the_plans_positions_and_unshards_them(reports):
    for rank in range(WORLD):
        got = reports[rank]["sharding"]
        assert "error" not in got, got.get("error")
        assert got == {
            "table_cut_inside": True,
            "batch_kept_cut": True,
            "table_whole_after": True,
            "unshard": True,
        }


def test_document_masks_matter_on_the_test_packings():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, 4, S, D, generator=g) for _ in range(3))
    causal = whole_attention(q, k, v, dense_mask(PACKINGS["one_document_over_every_chunk"]()))
    for packing in ("length_1_documents", "many_documents_in_one_chunk", "lognormal_mix"):
        documents = whole_attention(q, k, v, dense_mask(PACKINGS[packing]()))
        assert (causal - documents).abs().max() > 0.1, packing  # far beyond the tolerance


# ----------------------------------------------------------------------------- the plan alone


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_plan_deals_every_position_once_and_its_blocks_match_the_masks(cp):
    ids = lognormal_ids(5, batch=2, seq=256)
    plans = [plan_document_ring(ids, cp, r) for r in range(cp)]
    assert sorted(plans[0].order.tolist()) == list(range(256))
    full = (ids[:, :, None] == ids[:, None, :]) & torch.ones(256, 256, dtype=torch.bool).tril()
    for r, plan in enumerate(plans):
        assert torch.equal(plan.order, plans[0].order)  # every rank makes the same plan
        # The work per rank is the allowed (query, key) pairs of its queries.
        assert plan.work[r] == int(full[:, plan.positions(r)].sum())
    n, size = len(plans[0].blocks), plans[0].size
    for qc in range(n):
        for kc in range(n):
            block = full[:, qc * size : (qc + 1) * size, kc * size : (kc + 1) * size]
            assert plans[0].blocks[qc][kc] == bool(block.any()), (qc, kc)
            if block.any():
                mask = plans[0].block_mask(qc, kc)
                assert block.all() if mask is None else torch.equal(mask[:, 0], block)


def test_one_long_document_is_dealt_head_and_tail_and_short_ones_skip_blocks():
    one = torch.zeros(1, 1024, dtype=torch.long)
    plan = plan_document_ring(one, 4, 0, chunks=2)
    assert plan.owned == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert plan.imbalance == pytest.approx(head_tail_imbalance(one, 4)) == pytest.approx(1.0)
    assert plan.skipped_block_share == pytest.approx(0.0)  # every chunk sees every earlier one
    short = lognormal_ids(1, batch=1, seq=1024, mean=2.0)  # documents of ~7 tokens
    plan = plan_document_ring(short, 4, 0, chunks=8)  # chunks of 32
    assert plan.skipped_block_share > 0.8


def test_decreasing_document_ids_are_refused():
    with pytest.raises(ValueError, match="must not decrease"):
        plan_document_ring(torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]]), 2, 0)


@pytest.mark.parametrize("seed", range(5))
def test_document_dealing_is_at_least_as_even_as_head_and_tail(seed):
    # Log-normal documents of a few hundred tokens packed into 8192 (see bench/README).
    ids = lognormal_ids(seed, batch=1, seq=8192, mean=6.0)
    for cp in (2, 4):
        dealt = plan_document_ring(ids, cp, 0).imbalance
        assert dealt <= head_tail_imbalance(ids, cp) + 1e-9
        assert dealt < 1.05


def test_on_fake_tensors_the_plan_is_one_documents():
    # The dry run's tensors cannot be read: it plans the ring's most work, one document.
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = plan_document_ring(torch.zeros(2, 1024, dtype=torch.long), 4, 1)
    with FakeTensorMode():
        fake = plan_document_ring(torch.zeros(2, 1024, dtype=torch.long), 4, 1)
        mask = fake.block_mask(3, 3)
        assert mask.shape == (2, 1, fake.size, fake.size)
    assert fake.fake and not real.fake
    assert (fake.owned, fake.work, fake.blocks) == (real.owned, real.work, real.blocks)
    assert fake.block_mask(5, 2) is None and real.block_mask(5, 2) is None


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_pairs_on_cuda_merge_to_block_causal_attention(dtype):
    # What each rank computes on CUDA, without the exchange: the pairs (one query chunk against
    # each key chunk it sees) merged by log-sum-exp, and their backward from the merged output,
    # against block-causal attention over the whole sequence. bf16: 2e-2 (the kernel's own
    # rounding of q, k, v and the output; fp32: 1e-5, TF32 off).
    torch.backends.cuda.matmul.allow_tf32 = False
    _pairs_merge_to_block_causal_attention("cuda", dtype)


def test_the_pairs_cuda_runs_merge_to_block_causal_attention_on_the_cpu():
    # The same code path as on CUDA (the plain formulas), on the CPU in fp32.
    document_ring._Kernel.plain = True
    try:
        _pairs_merge_to_block_causal_attention("cpu", torch.float32)
    finally:
        document_ring._Kernel.plain = False


def _pairs_merge_to_block_causal_attention(device: str, dtype: torch.dtype) -> None:
    from titan_parallel.document_ring import _Mask, _merge, _pair_backward, _pair_forward

    ids = lognormal_ids(4, batch=2, seq=256, mean=3.0).to(device)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 256, 16, generator=g).to(device).to(dtype) for _ in range(3))
    full = (ids[:, :, None] == ids[:, None, :]) & torch.ones(256, 256, dtype=torch.bool).tril().to(
        device
    )
    ref_in = [t.float().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=full[:, None])
    grad = torch.randn_like(ref)
    ref.backward(grad)
    size, scale = 64, 16**-0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device=device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=device)
    for a in range(4):
        rows = slice(a * size, (a + 1) * size)
        for b in range(a + 1):
            cols = slice(b * size, (b + 1) * size)
            mask = _Mask(full[:, None, rows, cols])
            o, s = _pair_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, scale)
            out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o, s)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out - ref.detach()).abs().max() < tol
    dq, dk, dv = (torch.zeros(t.shape, device=device) for t in (q, k, v))
    for a in range(4):
        rows = slice(a * size, (a + 1) * size)
        for b in range(a + 1):
            cols = slice(b * size, (b + 1) * size)
            got = _pair_backward(
                grad[:, :, rows].to(dtype), q[:, :, rows], k[:, :, cols], v[:, :, cols],
                out[:, :, rows].to(dtype), lse[:, :, rows], _Mask(full[:, None, rows, cols]), scale,
            )  # fmt: skip
            dq[:, :, rows] += got[0].float()
            dk[:, :, cols] += got[1].float()
            dv[:, :, cols] += got[2].float()
    for mine, r in zip((dq, dk, dv), ref_in):
        assert (mine - r.grad).abs().max() < tol * 10
