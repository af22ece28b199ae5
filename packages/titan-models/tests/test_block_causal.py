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

from titan_models import llama3_flavors, llama3_spec
from titan_models.attention import build_attention_mask, document_ids
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
}
FLAVORS = {
    "llama3": llama3_flavors["debugmodel"],
    "qwen3": qwen3_flavors["debugmodel"],
    "qwen3_moe": qwen3_flavors["debugmodel_moe"],
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

    cpu = torch.device("cpu")
    assert attention.check_block_causal(cpu) == []  # dense, forward and backward
    assert attention.check_block_causal(cpu, flex=True) == []  # FlexAttention, forward
    monkeypatch.setattr(attention, "same_document_and_causal", lambda ids: _causal_only)
    problems = attention.check_block_causal(cpu, flex=True)
    assert [p.split(":")[0] for p in problems] == [
        "torch.float32 forward",
        "torch.bfloat16 forward",
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
    reason="needs CUDA: FlexAttention's kernels (and its backward) are compiled by Triton for a GPU",
)
def test_flex_attention_on_cuda_matches_the_dense_mask_in_float32_and_bfloat16():
    from titan_models.attention import check_block_causal

    assert check_block_causal(torch.device("cuda")) == []


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: FlexAttention's kernels (and its backward) are compiled by Triton for a GPU",
)
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_flex_attention_on_cuda_matches_the_dense_mask_on_cpu_forward_and_backward(name):
    _, _, packed = packed_documents([40, 100, 60, 56], seed=1)  # 261 tokens: 3 blocks of 128
    # One model, copied to the GPU: the weights must be the same on both sides, and a model
    # initialised on CUDA draws other values (CUDA's generators are not the CPU's).
    cpu_model = build(name, packed.shape[1])
    models = {"cpu": cpu_model, "cuda": copy.deepcopy(cpu_model).to("cuda")}
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
