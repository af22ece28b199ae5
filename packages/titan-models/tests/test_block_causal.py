"""Block-causal attention (`document_ids`): a packed sample gives each of its documents the
logits and loss that document gets alone, for every family; plain causal attention does not.
On CUDA the mask runs through FlexAttention, whose result must equal the dense mask's."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from titan_core.device import supports_bf16
from titan_models import llama3_flavors, llama3_spec
from titan_models.attention import build_attention_mask, document_ids
from titan_models.block_causal import (
    CHECK_TOLERANCE,
    attend_block_causal,
    check_block_causal,
    document_offsets,
)
from titan_models.gemma3 import gemma3_flavors, gemma3_spec
from titan_models.qwen3 import qwen3_flavors, qwen3_spec

BOS = 1
FAMILIES = {
    "llama3": (llama3_spec, dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97)),
    "qwen3": (
        qwen3_spec,
        dict(
            dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=97
        ),
    ),
    "qwen3_moe": (qwen3_spec, dict(vocab_size=97)),
    # A local block (window 8, shorter than most documents), then a global one.
    "gemma3": (
        gemma3_spec,
        dict(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            hidden_dim=96,
            vocab_size=97,
            sliding_window=8,
            global_every=2,
        ),
    ),  # fmt: skip
}
FLAVORS = {
    "llama3": llama3_flavors["debugmodel"],
    "qwen3": qwen3_flavors["debugmodel"],
    "qwen3_moe": qwen3_flavors["debugmodel_moe"],
    "gemma3": gemma3_flavors["debugmodel"],
}


def build(name: str, seq: int, device="cpu"):
    spec, changes = FAMILIES[name]
    args = dataclasses.replace(FLAVORS[name], max_seq_len=seq, **changes)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    return model.float().eval()


def packed_documents(lengths, seed=0):
    """Documents of the given lengths, each BOS + random ids, and their concatenation, after
    the tail of an earlier document (a packed window rarely starts at a document's start)."""
    g = torch.Generator().manual_seed(seed)
    docs = [
        torch.cat([torch.tensor([BOS]), torch.randint(2, 97, (n - 1,), generator=g)])
        for n in lengths
    ]
    tail = torch.randint(2, 97, (5,), generator=g)
    return tail, docs, torch.cat([tail, *docs])[None]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_packed_sample_gives_each_document_its_own_losses(name):
    tail, docs, packed = packed_documents([9, 17, 12, 7])
    seq = packed.shape[1]
    model = build(name, seq)
    with torch.no_grad():
        logits = model(packed, document_ids=document_ids(packed, BOS))[0]
        causal = model(packed)[0]
    start = len(tail)
    for doc in docs:
        with torch.no_grad():
            alone = model(doc[None])[0]
        own = logits[start : start + len(doc)]
        # fp32; the rotary angles of a document at offset `start` differ from those at 0 only
        # by rounding (cos/sin of larger arguments), a few 1e-6 relative: 1e-4 absolute on
        # logits of unit scale leaves a margin, and is far below what leaking across
        # documents changes (checked against plain causal attention below).
        assert torch.allclose(own, alone, atol=1e-4, rtol=0), (own - alone).abs().max()
        loss_packed = F.cross_entropy(own[:-1], doc[1:])
        loss_alone = F.cross_entropy(alone[:-1], doc[1:])
        assert abs(loss_packed.item() - loss_alone.item()) < 1e-5
        if start > len(tail):  # a later document under plain causal attention sees the others
            assert (causal[start : start + len(doc)] - alone).abs().max() > 1e-2
        start += len(doc)


def test_document_ids_count_the_documents_started_so_far():
    tokens = torch.tensor([[5, 6, BOS, 7, 8, BOS, BOS, 9], [BOS, 2, 3, 4, 5, 6, 7, 8]])
    assert document_ids(tokens, BOS).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3], [1] * 8]


def test_the_cpu_mask_is_causal_within_each_document_only():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = build_attention_mask(ids)
    assert mask.block_mask is None and mask.dense.shape == (1, 1, 6, 6)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask.dense[0, 0], expected)
    assert build_attention_mask(None) is None


def test_the_flex_attention_path_matches_the_dense_mask_on_cpu_and_its_check_catches_a_leak(
    monkeypatch,
):
    """The CUDA path's mask (a FlexAttention BlockMask from the document ids) and its call,
    run on the CPU (forward only: FlexAttention has no CPU backward), against the dense mask;
    the dense path (what CPU runs use) forward and backward. Then the same check with a mask
    that ignores the documents must fail, by far more than its tolerance."""
    import titan_models.attention as attention
    import titan_models.block_causal as block_causal

    cpu = torch.device("cpu")
    assert attention.check_block_causal(cpu) == []  # dense, forward and backward
    assert attention.check_block_causal(cpu, "flex", backward=False) == []  # FlexAttention
    monkeypatch.setattr(
        block_causal, "same_document_and_causal", lambda ids, window=None: _causal_only
    )
    problems = attention.check_block_causal(cpu, "flex", backward=False)
    assert [p.split(":")[0] for p in problems] == [
        "flex torch.float32 forward",
        "flex torch.bfloat16 forward",
    ]
    # Each difference is a good fraction of the result's scale, far above the tolerance.
    for problem in problems:
        error, scale = re.search(r"difference (\S+) .*largest value (\S+);", problem).groups()
        assert float(error) > 0.3 * float(scale), problem


def _causal_only(b, h, q, kv):
    return q >= kv


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: compiled FlexAttention (Triton) and varlen flash attention run on a GPU only",
)
@pytest.mark.parametrize("impl", ["flex", "varlen"])
def test_each_cuda_implementation_matches_the_dense_mask_in_float32_and_bfloat16(impl):
    # Compiled FlexAttention / torch's varlen flash attention (bf16; float32 runs SDPA per
    # document) against SDPA with the dense mask on the GPU, forward and backward
    # (CHECK_TOLERANCE: TF32 and bf16 rounding).
    assert check_block_causal(torch.device("cuda"), impl) == []


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: compiled FlexAttention (Triton) and varlen flash attention run on a GPU only",
)
@pytest.mark.parametrize("impl", ["flex", "varlen"])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_each_cuda_implementation_matches_the_dense_mask_on_cpu_forward_and_backward(name, impl):
    _, _, packed = packed_documents([40, 100, 60, 56], seed=1)  # 261 tokens: 3 blocks of 128
    # One model, copied to the GPU: the weights must be the same on both sides, and a model
    # initialised on CUDA draws other values (CUDA's generators are not the CPU's).
    cpu_model = build(name, packed.shape[1])
    models = {"cpu": cpu_model, "cuda": copy.deepcopy(cpu_model).to("cuda")}
    models["cpu"].block_causal_impl = "dense"
    models["cuda"].block_causal_impl = impl
    runs = {}
    for device, model in models.items():  # dense mask on the CPU, FlexAttention on CUDA
        tokens = packed.to(device)
        logits = model(tokens, document_ids=document_ids(tokens, BOS))
        logits.square().mean().backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
        runs[device] = (logits.detach().cpu(), grads)
    (cpu_logits, cpu_grads), (gpu_logits, gpu_grads) = runs["cpu"], runs["cuda"]
    # fp32 on both (no TF32 by default): the kernels sum in different orders, which moves
    # results by ~1e-6 relative; 1e-4 leaves a margin, and a mask that let one document see
    # another would change the logits by more than 1e-2 (see the test above).
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-4, rtol=1e-4)
    for n, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[n], grad, atol=1e-4, rtol=1e-3, msg=n)


# Packings whose boundaries are easy to get wrong, as document lengths per row (every row of
# a batch the same length): a document over the whole row, one-token documents (first, last,
# in a run), many short documents, rows that differ.
TRICKY_PACKINGS = {
    "whole_row": [[24], [24]],
    "one_token_documents": [[1, 1, 5, 1, 1, 1, 13, 1], [1] * 24],
    "many_documents": [[2, 3, 1, 4, 2, 1, 3, 2, 1, 5], [23, 1]],
}


def _ids(rows) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    )


def _attention_and_grads(ids, impl, inputs, weights, *, backward=True):
    leaves = [t.detach().clone().requires_grad_(backward) for t in inputs]
    mask = build_attention_mask(ids, impl=impl)
    with torch.set_grad_enabled(backward):
        out = attend_block_causal(*leaves, mask)
    if not backward:
        return [out]
    (out.float() * weights).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


def test_every_implementation_equals_the_dense_mask_on_tricky_packings_in_float32():
    """varlen (its CPU path: SDPA per document from the same cu_seqlens) forward and backward,
    FlexAttention forward (no CPU backward), against SDPA with the dense mask: 1e-5."""
    g = torch.Generator().manual_seed(0)
    for name, rows in TRICKY_PACKINGS.items():
        ids = _ids(rows)
        batch, seq = ids.shape
        q = torch.randn(batch, 4, seq, 8, generator=g)
        k, v = (torch.randn(batch, 2, seq, 8, generator=g) for _ in "kv")  # GQA: 2 kv heads
        weights = torch.randn(batch, 4, seq, 8, generator=g)
        want = _attention_and_grads(ids, "dense", (q, k, v), weights)
        for impl, backward in (("varlen", True), ("flex", False)):
            got = _attention_and_grads(ids, impl, (q, k, v), weights, backward=backward)
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=False):
                # fp32: the kernels only sum in other orders (~1e-7 here).
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} {impl} {what}")


def test_document_offsets_cut_the_flattened_batch_at_each_document_and_row():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5], [0, 1, 2, 3, 3, 3]])
    cu_seqlens, max_seqlen = document_offsets(ids)
    # A row's end ends its document even when the next row starts with the same id.
    assert cu_seqlens.tolist() == [0, 2, 5, 6, 12, 13, 14, 15, 18]
    assert cu_seqlens.dtype == torch.int32 and max_seqlen == 6


def test_the_varlen_check_catches_documents_that_leak(monkeypatch):
    """The same check with offsets that keep each row whole (plain causal attention) fails."""
    import titan_models.block_causal as block_causal

    cpu = torch.device("cpu")
    assert check_block_causal(cpu, "varlen", dtypes=(torch.float32,)) == []

    def whole_rows(ids):
        batch, seq = ids.shape
        return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32), seq

    monkeypatch.setattr(block_causal, "document_offsets", whole_rows)
    problems = check_block_causal(cpu, "varlen", dtypes=(torch.float32,))
    assert [p.split(":")[0] for p in problems] == [
        f"varlen torch.float32 {w}" for w in ("forward", "dq", "dk", "dv")
    ]


def test_flex_on_the_cpu_is_refused_for_training_with_the_reason():
    problems = check_block_causal(torch.device("cpu"), "flex")
    assert len(problems) == 1 and "no backward on cpu" in problems[0]
    assert "block_causal_impl = 'dense' or 'varlen'" in problems[0]


@pytest.mark.skipif(
    not supports_bf16(torch.device("cpu")),
    reason="this CPU has no native bf16 instructions (avx512_bf16 / amx_bf16)",
)
def test_varlen_in_bfloat16_matches_the_float32_dense_mask_within_its_tolerance():
    # CHECK_TOLERANCE[bf16]: 8-bit mantissa, a few roundings deep.
    assert CHECK_TOLERANCE[torch.bfloat16] == 3e-2
    assert check_block_causal(torch.device("cpu"), "varlen", dtypes=(torch.bfloat16,)) == []


def test_a_model_gives_the_same_logits_and_gradients_with_each_implementation():
    """The model's own plumbing (`block_causal_impl`, one mask per forward shared by the
    layers): varlen against dense, fp32, forward and backward, 1e-5."""
    _, _, packed = packed_documents([1, 9, 17, 1, 12, 7])
    model = build("llama3", packed.shape[1])
    ids = document_ids(packed, BOS)
    runs = {}
    for impl in ("dense", "varlen"):
        model.zero_grad()
        model.block_causal_impl = impl
        logits = model(packed, document_ids=ids)
        logits.square().mean().backward()
        runs[impl] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (dense_logits, dense_grads), (varlen_logits, varlen_grads) = runs["dense"], runs["varlen"]
    torch.testing.assert_close(varlen_logits, dense_logits, atol=1e-5, rtol=1e-5)
    for n, grad in dense_grads.items():
        torch.testing.assert_close(varlen_grads[n], grad, atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: compiled FlexAttention (Triton) and varlen flash attention run on a GPU only",
)
@pytest.mark.parametrize("impl", ["flex", "varlen"])
def test_each_cuda_kernel_matches_the_dense_mask_on_tricky_packings_in_bfloat16(impl):
    """The kernels themselves (varlen's flash kernel takes bf16 only) on the tricky packings,
    forward and backward, against the float32 dense mask on the same GPU."""
    g = torch.Generator().manual_seed(0)
    for name, rows in TRICKY_PACKINGS.items():
        ids = _ids(rows).cuda()
        batch, seq = ids.shape
        q, weights = (torch.randn(batch, 4, seq, 16, generator=g).cuda() for _ in "qw")
        k, v = (torch.randn(batch, 2, seq, 16, generator=g).cuda() for _ in "kv")
        want = _attention_and_grads(ids, "dense", (q, k, v), weights)
        low = [t.bfloat16() for t in (q, k, v)]
        got = _attention_and_grads(ids, impl, low, weights)
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            # bf16: 8 mantissa bits, a few roundings deep (CHECK_TOLERANCE's reason).
            error = (a.float() - b).abs().max().item()
            assert error <= CHECK_TOLERANCE[torch.bfloat16] * b.abs().max().item(), (
                name,
                what,
                error,
            )


def test_every_mask_keeps_its_ids_and_varlen_takes_fake_ids_as_one_document_per_row():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_core import DocumentMask
    from titan_models.block_causal import build_attention_mask, document_offsets

    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    for impl in ("dense", "varlen"):
        mask = build_attention_mask(ids, impl=impl)
        assert isinstance(mask, DocumentMask) and mask.document_ids is ids
    cu, longest = document_offsets(ids)
    assert cu.tolist() == [0, 2, 5, 6, 7, 12] and longest == 5
    # A memory estimate's fake ids cannot be read: one document per row, the most work.
    with FakeTensorMode():
        cu, longest = document_offsets(torch.zeros(2, 6, dtype=torch.long))
        assert cu.shape == (3,) and longest == 6
