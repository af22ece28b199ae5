"""All-to-all context parallel (`titan_parallel.alltoall_attention`) on real gloo process groups,
against attention over the whole sequence in one process: fp32 outputs and the gradients of q,
k and v, causal and block-causal (a document mask the caller built for the whole sequence),
grouped key/value heads that divide by the degree and ones that must be repeated first. Four
ranks start once and run every case; the tests assert on what each rank reported.

Tolerance: the ranks compute the same attention on the same numbers, only moved; the sums run
in another order only where a kernel tiles differently by shape, so 1e-5 absolute (measured:
below 1e-6)."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from titan_core import HeadAttention
from titan_parallel.alltoall_attention import (
    alltoall_heads_problems,
    alltoall_scope,
    apply_alltoall_cp,
    kv_repeats,
)

WORLD, B, S, D = 4, 2, 16, 8
TOLERANCE = 1e-5


def whole_attention(q, k, v, mask):
    """Grouped heads repeated, then causal (mask None) or under a boolean [b, 1, s, s] mask."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Layer(nn.Module, HeadAttention):
    def __init__(self, heads: int, kv: int) -> None:
        super().__init__()
        self.heads = (heads, kv)

    def attend(self, q, k, v, mask):
        return whole_attention(q, k, v, mask)

    def attention_heads(self) -> tuple[int, int]:
        return self.heads


def document_mask(g: torch.Generator) -> torch.Tensor:
    """Packed documents of 1 to 6 tokens (some end exactly at a piece's border), causal within."""
    ids = torch.zeros(B, S, dtype=torch.long)
    for row in ids:
        at, doc = 0, 0
        while at < S:
            n = int(torch.randint(1, 7, (1,), generator=g))
            row[at : at + n] = doc
            at, doc = at + n, doc + 1
    same = ids[:, :, None] == ids[:, None, :]
    return (same & torch.ones(S, S, dtype=torch.bool).tril())[:, None]


def case(mesh, heads: int, kv: int, masked: bool) -> dict:
    cp, rank = mesh.size(), mesh.get_local_rank()
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (heads, kv, kv))
    mask = document_mask(g) if masked else None
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = whole_attention(*ref, mask)
    (out * out.detach().sin()).sum().backward()

    layer = Layer(heads, kv)
    apply_alltoall_cp(layer, mesh)
    n = S // cp
    mine = [t[:, :, rank * n : (rank + 1) * n].clone().requires_grad_() for t in (q, k, v)]
    with alltoall_scope():
        got = layer.attend(*mine, mask)
    (got * got.detach().sin()).sum().backward()
    piece = slice(rank * n, (rank + 1) * n)
    errors = {"out": (got - out[:, :, piece]).abs().max().item()}
    for name, m, r in zip("qkv", mine, ref):
        errors[f"grad_{name}"] = (m.grad - r.grad[:, :, piece]).abs().max().item()
    # Outside the scope the wrapped layer attends over its own piece only, as before wrapping.
    local = layer.attend(*(t.detach() for t in mine), None)
    errors["outside_scope"] = (
        (local - whole_attention(*(t.detach() for t in mine), None)).abs().max().item()
    )
    return errors


def context_case(mesh) -> dict:
    """`cp_context(style="alltoall")`: contiguous pieces in rank order, the batch kept cut and
    the model's table given back whole; `cp_unshard` puts the pieces together again."""
    from titan_parallel.context_parallel import cp_context, cp_unshard

    cp, rank = mesh.size(), mesh.get_local_rank()
    tokens = torch.arange(B * S).view(B, S)
    table = torch.arange(S * 3, dtype=torch.float32).view(S, 3)
    inputs, whole_table = tokens.clone(), table.clone()
    n = S // cp
    with cp_context(mesh, [inputs, table], [1, 0], {inputs}, style="alltoall"):
        inside = torch.equal(table, whole_table[rank * n : (rank + 1) * n])
    return {
        "table_cut_inside": inside,
        "batch_kept_cut": torch.equal(inputs, tokens[:, rank * n : (rank + 1) * n]),
        "table_whole_after": torch.equal(table, whole_table),
        "unshard": torch.equal(cp_unshard(mesh, [inputs], [1], style="alltoall")[0], tokens),
    }


def worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    four = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))["cp"]
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    cases = {
        "cp4_causal_kv_divides": (four, 8, 4, False),
        "cp4_causal_kv_repeated": (four, 8, 2, False),
        "cp4_documents_kv_repeated": (four, 8, 2, True),
        "cp2_documents_mha": (two, 4, 4, True),
        "cp2_causal_one_kv_head": (two, 4, 1, False),
    }
    report = {}
    for name, args in cases.items():
        try:
            report[name] = case(*args)
        except Exception:
            report[name] = {"error": traceback.format_exc()}
    try:
        report["context"] = context_case(four)
    except Exception:
        report["context"] = {"error": traceback.format_exc()}
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


CASES = [
    "cp4_causal_kv_divides",
    "cp4_causal_kv_repeated",
    "cp4_documents_kv_repeated",
    "cp2_documents_mha",
    "cp2_causal_one_kv_head",
]


@pytest.mark.parametrize("name", CASES)
def test_alltoall_attention_equals_whole_sequence_attention(reports, name):
    for rank in range(WORLD):
        errors = reports[rank][name]
        assert "error" not in errors, errors.get("error")
        assert max(errors.values()) < TOLERANCE, (rank, errors)


def test_cp_context_cuts_contiguous_pieces_and_gives_model_buffers_back(reports):
    for rank in range(WORLD):
        got = reports[rank]["context"]
        assert "error" not in got, got.get("error")
        assert got == {
            "table_cut_inside": True,
            "batch_kept_cut": True,
            "table_whole_after": True,
            "unshard": True,
        }


def test_document_masks_matter_on_the_test_packing():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (4, 4, 4))
    mask = document_mask(g)
    causal, documents = whole_attention(q, k, v, None), whole_attention(q, k, v, mask)
    assert (causal - documents).abs().max() > 0.1  # far beyond the tolerance above


def test_key_value_heads_are_repeated_to_the_fewest_copies_that_divide():
    assert kv_repeats(8, 4, 2) == 1
    assert kv_repeats(8, 2, 4) == 2
    assert kv_repeats(32, 8, 16) == 2
    assert kv_repeats(4, 1, 2) == 2
    assert kv_repeats(12, 4, 3) == 3  # 12 heads: 4 x 3 copies, one per query head
    assert kv_repeats(10, 2, 5) == 5  # at most one copy per query head, which always divides


def test_heads_that_do_not_divide_and_models_without_attention_layers_are_named():
    model = nn.Sequential(Layer(16, 8), Layer(16, 8))
    assert alltoall_heads_problems(model, tp=2, cp=4) == []
    (problem,) = alltoall_heads_problems(model, tp=2, cp=3)
    assert problem.startswith(
        "8 query heads per tensor-parallel rank (16 / tensor_parallel 2) do not divide by"
        " context_parallel_degree 3"
    ), problem
    assert problem.endswith(
        "use context_parallel_style = 'ring', or a context_parallel_degree that divides 8"
    )
    (problem,) = alltoall_heads_problems(nn.Linear(2, 2), tp=1, cp=2)
    assert "Linear has no attention layer that all-to-all context parallel can find" in problem
