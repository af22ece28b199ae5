"""Muon in one process: its matrices take torch.optim.Muon's steps, its other parameters
torch.optim.AdamW's; Newton-Schulz brings every singular value near 1 and takes a stack of
expert matrices one by one; the default grouping gives embeddings, heads, routers and vectors
to AdamW; bad arguments are refused. The layouts are in test_ranger21_parity.py."""

from __future__ import annotations

import pytest
import torch
from parallel_testmodel import TinyTransformer, cross_entropy
from torch import nn

from titan_parallel import Muon, muon_param_groups, newton_schulz, uses_muon
from titan_parallel.muon import _chunk_sizes, lr_scale


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    return nn.Parameter(w.clone()), nn.Parameter(w.clone())


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_matrices_take_torch_muons_steps(adjust_lr):
    ours, theirs = _pair((48, 32))
    opt = Muon([ours], lr=0.02, weight_decay=0.1, adjust_lr=adjust_lr)
    ref = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grad = torch.randn(48, 32, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    # Both run Newton-Schulz in bfloat16 (torch's is fixed to it); ours batches its matmuls
    # (baddbmm) where torch's uses addmm, so bf16 rounding differs a little per step: the
    # weights (size ~1, four updates of ~0.02-0.1) agree to a few bf16 ulps of the updates.
    diff = (ours - theirs).abs().max().item()
    moved = (theirs.detach() - _pair((48, 32))[0]).abs().max().item()
    assert diff < 2e-2 * moved, (diff, moved)


def test_other_parameters_take_torch_adamws_steps():
    ours, theirs = _pair((16, 8))
    vec_ours, vec_theirs = _pair((8,), seed=3)
    opt = Muon(
        [{"params": [ours, vec_ours], "use_muon": False}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8
    )
    ref = torch.optim.AdamW([theirs, vec_theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        for a, b in ((ours, theirs), (vec_ours, vec_theirs)):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    # The same fp32 formulas, in another order of operations: a few ulps.
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vec_ours, vec_theirs, rtol=1e-6, atol=1e-6)


def test_newton_schulz_brings_singular_values_near_one_per_expert():
    g = torch.Generator().manual_seed(0)
    stack = torch.randn(3, 64, 24, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    out = newton_schulz(stack, dtype=torch.float32)
    for k in range(3):
        s = torch.linalg.svdvals(out[k])
        # Jordan's coefficients trade exactness for speed: singular values end in ~[0.7, 1.2].
        assert s.min() > 0.6 and s.max() < 1.25, s
        torch.testing.assert_close(out[k], newton_schulz(stack[k], dtype=torch.float32))
    # The orthogonalised matrix points along the input's singular vectors.
    u, _, vh = torch.linalg.svd(stack[1], full_matrices=False)
    assert torch.nn.functional.cosine_similarity(out[1].flatten(), (u @ vh).flatten(), 0) > 0.95


def test_default_groups_give_embeddings_heads_routers_and_vectors_to_adamw():
    model = TinyTransformer()
    groups = muon_param_groups(model, lr=3e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in groups[0]["params"]}
    adamw = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["use_muon"] and not groups[1]["use_muon"] and groups[1]["lr"] == 3e-4
    assert "tok_embeddings.weight" in adamw and "output.weight" in adamw
    assert all(n.startswith("layers.") and "norm" not in n for n in muon), muon
    assert "layers.0.attention.wq.weight" in muon and "layers.1.feed_forward.w2.weight" in muon
    assert not uses_muon("layers.0.feed_forward.router.gate.weight", torch.empty(8, 16))
    assert uses_muon("layers.0.feed_forward.experts.w1", torch.empty(8, 16, 4))
    assert uses_muon("layers.0._orig_mod.attention.wq.weight", torch.empty(4, 4))


def test_muon_trains_the_tiny_transformer():
    torch.manual_seed(0)
    model = TinyTransformer()
    model.init_weights()
    opt = Muon(muon_param_groups(model), lr=2e-2, adjust_lr="match_rms_adamw")
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (4, 9), generator=g)
    losses = []
    for _ in range(8):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    kinds = {frozenset(s) for s in opt.state.values()}
    assert kinds == {
        frozenset({"step", "momentum_buffer"}),
        frozenset({"step", "exp_avg", "exp_avg_sq"}),
    }


def test_scales_and_shard_sizes():
    assert lr_scale(torch.Size([64, 16]), "original") == 2.0
    assert lr_scale(torch.Size([16, 64]), "original") == 1.0
    assert lr_scale(torch.Size([8, 16, 64]), "match_rms_adamw") == pytest.approx(1.6)
    # Experts stack (experts, in, out): 64 outputs of 16 inputs, as nn.Linear's (64, 16).
    assert lr_scale(torch.Size([8, 16, 64]), "original") == 2.0
    # DTensor's Shard splits like torch.chunk, with empty chunks at the end.
    for length, n in ((5, 4), (8, 2), (3, 4), (7, 3)):
        expected = [len(c) for c in torch.arange(length).chunk(n)]
        assert _chunk_sizes(length, n) == expected + [0] * (n - len(expected))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([{"params": [nn.Parameter(torch.ones(4))], "use_muon": True}])
    with pytest.raises(ValueError, match="momentum = 1.5"):
        Muon([nn.Parameter(torch.ones(4, 4))], momentum=1.5)
    with pytest.raises(ValueError, match="distributed = 'scatter'"):
        Muon([nn.Parameter(torch.ones(4, 4))], distributed="scatter")


def test_auto_newton_schulz_dtype_follows_the_devices_native_bf16(monkeypatch):
    from titan_parallel import muon as muon_module
    from titan_parallel.muon import newton_schulz_dtype

    cpu, meta = torch.zeros(2, 2), torch.zeros(2, 2, device="meta")
    for native in (False, True):
        monkeypatch.setattr(muon_module, "supports_bf16", lambda device, native=native: native)
        want = torch.bfloat16 if native else torch.float32
        assert newton_schulz_dtype("auto", [{"params": [cpu]}]) == want
    # a dry run on the meta device plans for the GPU's bfloat16; an explicit choice is kept
    assert newton_schulz_dtype("auto", [{"params": [meta]}]) == torch.bfloat16
    assert newton_schulz_dtype("float32", [{"params": [meta]}]) == torch.float32
    assert newton_schulz_dtype("bfloat16", [{"params": [cpu]}]) == torch.bfloat16
