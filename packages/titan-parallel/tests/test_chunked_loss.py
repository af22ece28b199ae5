"""The chunked linear + cross-entropy (`titan_parallel.chunked_loss`): the same loss and
gradients as the unchunked one, and a peak without the float32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from titan_parallel import (
    StepMemoryTracker,
    chunked_cross_entropy,
    defer_output,
    fake_tensors,
)
from titan_parallel.chunked_loss import IGNORE_INDEX, DeferredLinear


def _case(batch=2, seq=13, dim=16, vocab=37):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, dim, generator=g, dtype=torch.float64).float()
    weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :3] = IGNORE_INDEX  # padding and masked prompt tokens count for nothing
    labels[1, -1] = IGNORE_INDEX
    return hidden.requires_grad_(), weight, labels


def _grads(loss_fn, hidden, weight, labels):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = loss_fn(h, w, labels)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _unchunked(h, w, labels):
    return F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), labels.flatten())


@pytest.mark.parametrize("chunk", [1, 5, 8, 26, 100])  # 5 and 8 leave a short last chunk of 26
def test_chunked_loss_and_gradients_equal_the_unchunked(chunk):
    hidden, weight, labels = _case()
    want = _grads(_unchunked, hidden, weight, labels)
    got = _grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    # float32 throughout; only the order of the sum over tokens differs (chunk by chunk,
    # then divided once, vs one reduction): a few ulps at these magnitudes.
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunked_loss_without_gradients_and_with_no_counted_label():
    hidden, weight, labels = _case()
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, weight, labels, 4), _unchunked(hidden, weight, labels)
        )
        none = torch.full_like(labels, IGNORE_INDEX)
        # As F.cross_entropy's mean: 0 / 0.
        assert chunked_cross_entropy(hidden, weight, none, 4).isnan()
    with pytest.raises(ValueError, match="positive number of tokens"):
        chunked_cross_entropy(hidden, weight, labels, 0)


def test_defer_output_keeps_the_parameter_and_hands_back_hidden_states():
    model = nn.Module()
    model.output = nn.Linear(8, 11, bias=False)
    weight = model.output.weight
    deferred = defer_output(model)
    assert isinstance(model.output, DeferredLinear) and model.output.weight is weight
    assert [n for n, _ in model.named_parameters()] == ["output.weight"]
    x = torch.randn(2, 8)
    assert deferred(x) is x
    with pytest.raises(TypeError, match="plain nn.Linear without bias"):
        defer_output(model)  # already deferred: not a plain nn.Linear any more


class _Head(nn.Module):
    """Hidden states from a small projection, then the output projection: the loss's memory
    dominates."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.output(self.proj(x))


def test_chunked_loss_peak_drops_by_about_the_float32_logits():
    tokens, dim, vocab, chunk = 2048, 64, 32768, 256
    logits = tokens * vocab * 4  # 256 MiB of float32 logits
    peaks = {}
    with fake_tensors():
        x = torch.randn(1, tokens, dim)
        labels = torch.randint(0, vocab, (1, tokens))
        for name in ("unchunked", "chunked"):
            model = _Head(dim, vocab)
            if name == "chunked":
                defer_output(model)

                def loss(model=model):
                    return chunked_cross_entropy(model(x), model.output.weight, labels, chunk)
            else:

                def loss(model=model):
                    return F.cross_entropy(model(x).flatten(0, 1).float(), labels.flatten())

            tracker = StepMemoryTracker([model], None)
            with tracker:
                loss().backward()
            peaks[name] = tracker.peak().total
    # Unchunked holds the logits and their float32 log-softmax (saved for backward), then
    # their gradient; chunked a chunk's worth of each (chunk / tokens = 1/8 of the logits).
    assert peaks["unchunked"] - peaks["chunked"] >= logits, peaks
    assert peaks["chunked"] <= logits, peaks
