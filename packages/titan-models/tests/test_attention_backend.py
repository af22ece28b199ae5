"""The SDPA kernel chosen per shape (`titan_models.attention_backend`): the pick runs the shape
and computes what torch's own dispatch computes; a kernel that cannot run says why; a model's
layers carry the choice through meta-device build and a fullgraph compile."""

import pytest
import torch
from conftest import build_model

from titan_models.attention_backend import (
    ATTENTION_BACKENDS,
    AttentionShape,
    SDPAChoice,
    attention_candidates,
    choose_attention_backend,
    run_attention,
    runnable_choice,
    set_attention_backend,
)

SHAPE = AttentionShape(batch=2, heads=4, kv_heads=2, seq=64, head_dim=16)


def _forward_backward(choice, dtype, device, shape=SHAPE):
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(
        shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen, device=device
    )
    k = torch.randn(shape.batch, shape.kv_heads, shape.seq, shape.head_dim, generator=gen, device=device)  # fmt: skip
    v = torch.randn(k.shape, generator=gen, device=device)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = run_attention(q, k, v, choice)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=gen, device=device).to(dtype))  # fmt: skip
    return out, grads


def _assert_matches_default(choice, dtype, device, tol, shape=SHAPE):
    (out, grads), (ref, ref_grads) = (
        _forward_backward(c, dtype, device, shape) for c in (choice, None)
    )
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=tol, rtol=tol)


def test_choice_runs_the_shape_and_matches_torchs_dispatch_on_cpu():
    result = choose_attention_backend(*_args(SHAPE), torch.float32, "cpu", warmup=0, reps=1)
    # Both CPU kernels run this shape (grouped heads in place), so both were timed.
    assert set(result.timings) == {"flash", "math"} and result.skipped == {}
    assert result.best.name == next(iter(result.timings))  # the fastest first
    assert min(result.timings.values()) == result.timings[result.best.name] > 0
    assert result.summary().startswith(f"{result.best.name} ")
    # Every candidate, the pick included, against torch's own dispatch: 1e-5 in float32, the
    # kernels sum the softmax and the gradients in different orders.
    for name in attention_candidates("cpu"):
        choice, why = runnable_choice(name, SHAPE, torch.float32, "cpu")
        assert choice is not None and not choice.repeat_kv, why
        _assert_matches_default(choice, torch.float32, torch.device("cpu"), 1e-5)
    # Kept per shape: asked again, nothing is timed again.
    assert choose_attention_backend(*_args(SHAPE), torch.float32, "cpu", warmup=0, reps=1) is result


def test_kernels_that_cannot_run_a_shape_say_why():
    # The CUDA-only kernels on a CPU: torch refuses them, and its reason is kept.
    for name in ("cudnn", "efficient"):
        choice, why = runnable_choice(name, SHAPE, torch.float32, "cpu")
        assert choice is None and why == f"torch has no {name} kernel on cpu (it has flash, math)"
    # The math kernel at a long sequence is not even tried: 8 x 32 heads x 8192^2 floats.
    big = AttentionShape(batch=8, heads=32, kv_heads=8, seq=8192, head_dim=128)
    choice, why = runnable_choice("math", big, torch.bfloat16, "cpu")
    assert choice is None and "64.0 GiB" in why
    with pytest.raises(RuntimeError, match="no SDPA kernel runs causal attention"):
        only_cuda = ("cudnn", "efficient")  # on a CPU: nothing runs
        choose_attention_backend(1, 2, 2, 8, 8, torch.float32, "cpu", candidates=only_cuda)


def test_layers_keep_the_choice_through_meta_build_and_a_fullgraph_compile(tiny_args):
    model = build_model(tiny_args)
    reference = build_model(tiny_args)
    # Set on the meta-device model, before to_empty: it is a plain attribute and stays.
    with torch.device("meta"):
        meta = type(model)(tiny_args)
    math = SDPAChoice(ATTENTION_BACKENDS["math"])
    assert set_attention_backend(meta, math) == tiny_args.n_layers
    meta.to_empty(device="cpu")
    assert all(block.attention.sdpa_backend == math for block in meta.layers.values())

    assert set_attention_backend(model, math) == tiny_args.n_layers
    tokens = torch.randint(
        0, tiny_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    for block in model.layers.values():  # compiled per block, as titan-parallel compiles them
        block.compile(fullgraph=True, backend="aot_eager")
    compiled = model(tokens)
    compiled.float().square().mean().backward()
    expected = reference(tokens)
    expected.float().square().mean().backward()
    # Math against torch's pick (the CPU flash kernel) in float32: 1e-5, summation order.
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    # The compiled blocks obey the attribute (a guard on it re-traces them): a kernel the CPU
    # lacks fails there, it is not quietly replaced by torch's pick.
    set_attention_backend(model, SDPAChoice(ATTENTION_BACKENDS["cudnn"]))
    with pytest.raises(Exception, match="scaled_dot_product_attention"):
        model(tokens)


def test_repeated_kv_heads_match_grouped_ones():
    # The fallback for a kernel that refuses grouped heads, checked with one that takes both.
    repeated = SDPAChoice(ATTENTION_BACKENDS["flash"], repeat_kv=True)
    _assert_matches_default(repeated, torch.float32, torch.device("cpu"), 1e-5)


def _args(shape: AttentionShape):
    return shape.batch, shape.heads, shape.kv_heads, shape.seq, shape.head_dim


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the cuDNN, flash and memory-efficient kernels run on a GPU only")  # fmt: skip
def test_cuda_choice_is_among_the_cuda_kernels_and_matches_default_in_bf16():
    device = torch.device("cuda")
    shape = AttentionShape(batch=2, heads=8, kv_heads=2, seq=1024, head_dim=128)
    result = choose_attention_backend(*_args(shape), torch.bfloat16, device)
    assert result.best.backend in {ATTENTION_BACKENDS[n] for n in attention_candidates(device)}
    assert (
        "flash" in result.timings
    )  # flash runs bf16 grouped heads on every CUDA GPU torch supports
    # bf16 (8 bits of mantissa) over a softmax of 1024 keys: 2e-2.
    _assert_matches_default(result.best, torch.bfloat16, device, 2e-2, shape)
