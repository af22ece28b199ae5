"""Linear + cross-entropy over chunks of tokens, so the full float32 logits never exist.

A language model's last step, `logits = h @ W.T` followed by the mean cross-entropy in float32,
holds `tokens x vocab x 4` bytes of logits (Llama 3 8B at seq 8192: 8192 x 128256 x 4 = 3.9 GiB
per sequence), then their float32 log-softmax and their gradient. `chunked_cross_entropy`
runs the projection and the loss on `chunk_tokens` tokens at a time and, in the same pass,
each chunk's gradients for the hidden states and the weight (the loss is a scalar, so backward
only scales them): the peak holds one chunk's logits, and no matmul runs twice. The price is a
float32 buffer the size of the weight (Llama 3 8B: 2 GiB) and the hidden states' gradient held
from forward to backward, and smaller matmuls (bench/chunked_loss.py measures both).

`defer_output` turns a model's output projection into one whose forward hands back its input
(the hidden states), so that the loss can apply the weight chunk by chunk. The parameter stays
the same object under the same name (checkpoints, tied embeddings and FSDP groups are
unchanged); FSDP keeps the last group's parameters gathered after forward
(`apply_fsdp`), which is what lets the loss read the gathered weight outside that forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""The label that counts for no loss (F.cross_entropy's default `ignore_index`)."""


class DeferredLinear(nn.Linear):
    """An output projection whose forward returns its input unchanged; the loss applies
    `weight` itself (see `chunked_cross_entropy`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def defer_output(model: nn.Module, name: str = "output") -> DeferredLinear:
    """Replace `model.<name>` (a plain `nn.Linear` without bias) by a `DeferredLinear` that
    holds the same weight Parameter; returns it. Call before parallelizing the model."""
    linear = getattr(model, name, None)
    if type(linear) is not nn.Linear or linear.bias is not None:
        raise TypeError(
            f"{type(model).__name__}.{name} is a {type(linear).__name__}"
            f"{' with a bias' if isinstance(linear, nn.Linear) else ''}; the chunked loss"
            " needs a plain nn.Linear without bias (a converter such as Float8 must leave the"
            " output projection out)"
        )
    deferred = DeferredLinear(
        linear.in_features, linear.out_features, bias=False, device=linear.weight.device
    )
    deferred.weight = linear.weight  # the same Parameter: tied embeddings stay tied
    setattr(model, name, deferred)
    return deferred


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # The same arithmetic as the unchunked loss: the projection in the compute dtype (autocast
    # applies inside as outside), the cross-entropy in float32.
    logits = F.linear(h, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


class _GradientsInForward(torch.autograd.Function):
    """The loss and, chunk by chunk in the same pass, its gradients for the hidden states and
    the weight (the loss is a scalar: backward only scales them). No chunk's logits are kept
    or recomputed; the price is a float32 buffer the size of the weight from forward to
    backward."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk_tokens, count):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = 1.0 / count.clamp(min=1).float()
        for start in range(0, h.shape[0], chunk_tokens):
            rows, y = h[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            logits = F.linear(rows, weight)
            logits_dtype = logits.dtype  # the compute dtype (autocast's, if on)
            log_probs = logits.float().log_softmax(-1)
            del logits
            total += F.nll_loss(log_probs, y, ignore_index=IGNORE_INDEX, reduction="sum")
            # d(sum of -log p[label]) / d logits = softmax - one_hot, zero for ignored rows;
            # cast back to the logits' dtype as autograd does through `.float()`.
            counted = (y != IGNORE_INDEX).unsqueeze(1)
            grad = log_probs.exp_()
            del log_probs
            grad.scatter_add_(1, y.clamp(min=0).unsqueeze(1), -counted.to(grad.dtype))
            grad = (grad * (counted * scale)).to(logits_dtype)
            grad_h[start : start + chunk_tokens] = grad @ weight
            grad_w += grad.t() @ rows
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """The mean cross-entropy of `hidden @ weight.T` (`hidden` `[..., dim]`, `weight`
    `[vocab, dim]`) against `labels` (`hidden`'s leading shape) over the labels not
    `IGNORE_INDEX`, computed `chunk_tokens` tokens at a time; equal to
    `F.cross_entropy(F.linear(hidden, weight).flatten(0, -2).float(), labels.flatten())`,
    NaN as that is when no label counts."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens = {chunk_tokens}; use a positive number of tokens")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    count = (flat != IGNORE_INDEX).sum()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _GradientsInForward.apply(h, weight, flat, chunk_tokens, count)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):  # evaluation: the loss alone
        stop = start + chunk_tokens
        total = total + _chunk_loss_sum(h[start:stop], weight, flat[start:stop])
    return total / count
