"""The memory of compiled regions as the estimate simulates it (titan_parallel.compiled_memory),
and CUDA's kernels emulated on the CPU (titan_parallel.cuda_kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_testmodel import TinyArgs, TinyTransformer, cross_entropy
from torch import nn

from titan_parallel import (
    ActivationCheckpoint,
    Compile,
    StepMemoryTracker,
    apply_ac,
    apply_compile,
    cuda_kernels,
    fake_tensors,
    simulated_backend,
)


def _peak(parts, step) -> int:
    tracker = StepMemoryTracker(parts, None)
    with tracker:
        step()
    return tracker.peak().total


class _Logits(nn.Module):
    def __init__(self, rows: int, vocab: int):
        super().__init__()
        self.logits = nn.Parameter(torch.empty(rows, vocab, dtype=torch.bfloat16))


def _float32_cross_entropy(logits, labels):
    return F.cross_entropy(logits.float(), labels)


def test_compiled_cross_entropy_never_writes_its_float32_logits():
    rows, vocab = 512, 4096
    bf16, fp32 = rows * vocab * 2, rows * vocab * 4
    compiled = torch.compile(_float32_cross_entropy, backend=simulated_backend())
    peaks = {}
    with fake_tensors():
        for name, loss_fn in (("eager", _float32_cross_entropy), ("compiled", compiled)):
            peaks[name] = _loss_peak(loss_fn, rows, vocab)
    # Compiled: the bf16 logits and their bf16 gradient, plus a few floats per row (the max and
    # the log of the sum of exponentials the forward saves).
    assert peaks["compiled"] <= 2 * bf16 + 64 * rows, peaks
    # Eager writes the float32 copy and the float32 log-softmax, at least.
    assert peaks["eager"] >= peaks["compiled"] + 2 * fp32, peaks


def _loss_peak(loss_fn, rows: int, vocab: int) -> int:
    holder = _Logits(rows, vocab)
    labels = torch.randint(0, vocab, (rows,))
    return _peak([holder], lambda: loss_fn(holder.logits, labels).backward())


def _tiny(mode: str, compiled: bool) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(TinyArgs(vocab=128, dim=64, n_heads=4, hidden=192, n_layers=2))
    apply_ac(model, ActivationCheckpoint(mode=mode))
    if compiled:
        apply_compile(model, Compile(enable=True, backend=simulated_backend()))
    return model


def _step_peak(model: TinyTransformer) -> int:
    tokens = torch.randint(0, 128, (4, 257))
    return _peak([model], lambda: cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward())


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_compiled_blocks_count_the_same_on_fake_and_real_tensors(mode):
    with fake_tensors():
        fake = _step_peak(_tiny(mode, compiled=True))
    real_model = _tiny(mode, compiled=True)
    real_model.init_weights()
    real = _step_peak(real_model)
    # The same partitioned graphs run on both; only the tensors' storage differs.
    assert fake == real


def test_compiled_blocks_need_less_than_eager_and_checkpointing_less_still():
    peaks = {}
    with fake_tensors():
        for mode in ("none", "selective", "full"):
            for compiled in (False, True):
                peaks[mode, compiled] = _step_peak(_tiny(mode, compiled))
    # The partitioner recomputes cheap element-wise results instead of saving them, and fused
    # intermediates are never written: compiled blocks need less than eager ones.
    assert peaks["none", True] < peaks["none", False], peaks
    # Selective checkpointing keeps the matmuls' outputs; full keeps only the blocks' inputs.
    assert peaks["full", True] < peaks["selective", True] < peaks["none", True], peaks


def test_simulated_backend_keeps_the_eager_backends_and_simulates_inductor():
    assert simulated_backend("eager") == "eager"
    assert simulated_backend("aot_eager") == "aot_eager"
    assert callable(simulated_backend("inductor"))


def _saved_bytes(fn) -> int:
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cuda_rms_norm_gives_the_same_values_and_saves_only_input_and_rstd(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 32, dtype=dtype, requires_grad=True)
    weight = torch.randn(32, dtype=dtype, requires_grad=True)
    grad = torch.randn(6, 5, 32, dtype=dtype)
    want = F.rms_norm(x, (32,), weight, 1e-5)
    want_grads = torch.autograd.grad(want, (x, weight), grad)
    with cuda_kernels():
        norm = nn.RMSNorm(32, eps=1e-5, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        got = norm(x)
        got_grads = torch.autograd.grad(got, (x, norm.weight), grad)
    # float64: the same arithmetic in another order; bfloat16: both compute in float32 and
    # round once.
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(got, want, **tolerance)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tolerance)

    rstd = 6 * 5 * torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
    with cuda_kernels():
        ours = _saved_bytes(lambda: F.rms_norm(x, (32,), weight, 1e-5))
    assert ours == x.nbytes + weight.nbytes + rstd
    assert _saved_bytes(lambda: F.rms_norm(x, (32,), weight, 1e-5)) > ours  # the CPU kernels


def test_cuda_kernels_leave_compiled_code_to_the_compiler():
    norm = nn.RMSNorm(16)
    compiled = torch.compile(norm, backend="aot_eager", fullgraph=True)
    x = torch.randn(3, 16)
    with cuda_kernels():
        torch.testing.assert_close(compiled(x), norm(x))
