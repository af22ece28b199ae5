"""Linear + cross-entropy over chunks of tokens, so the full float32 logits never exist.

A language model's last step, `logits = h @ W.T` followed by the mean cross-entropy in float32,
holds `tokens x vocab x 4` bytes of logits (Llama 3 8B at seq 8192: 8192 x 128256 x 4 = 3.9 GiB
per sequence), and its backward as many again for their gradient. `chunked_cross_entropy` runs
the projection and the loss on `chunk_tokens` tokens at a time, each chunk under activation
checkpointing (`torch.utils.checkpoint`), so forward keeps only the summed loss and backward
recomputes one chunk's logits at a time: the peak holds a chunk's logits, not all of them. The
price is the projection's forward run twice (one extra `tokens x dim x vocab` matmul).

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
from torch.utils.checkpoint import checkpoint

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
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):
        stop = start + chunk_tokens
        if torch.is_grad_enabled():
            part = checkpoint(
                _chunk_loss_sum, h[start:stop], weight, flat[start:stop], use_reentrant=False
            )
        else:  # evaluation: nothing to save, nothing to recompute
            part = _chunk_loss_sum(h[start:stop], weight, flat[start:stop])
        total = total + part
    return total / (flat != IGNORE_INDEX).sum()
