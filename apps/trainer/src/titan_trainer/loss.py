"""The training objective: the mean token cross-entropy, and with multi-token prediction
(a model whose training forward returns a tuple of logits: the next token's, then those of
each depth k = 1..D, which predict the token k + 1 positions after the next one; see
titan-models' `titan_models.mtp`) DeepSeek-V3's combined loss

    loss = loss_main + weight / D x (loss_1 + ... + loss_D)

(arXiv:2412.19437, section 2.2; `[training] mtp_loss_weight` is the paper's lambda). Depth k
at position i predicts label i + k; the last k positions of a sample have no such label
within it and are left out of loss_k (`IGNORE`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE = -100
"""The label F.cross_entropy leaves out (its default `ignore_index`)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy over the labels not `IGNORE`, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def labels_ahead(labels: torch.Tensor, k: int) -> torch.Tensor:
    """`labels` ([batch, seq]) moved k positions left, `IGNORE` where the sample ends."""
    k = min(k, labels.shape[1])
    return F.pad(labels[:, k:], (0, k), value=IGNORE)


def with_mtp(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weight: float
) -> Callable:
    """`loss_fn(logits, labels)` extended to a multi-token-prediction model's tuple of
    logits (see the module docstring); a plain tensor of logits goes to `loss_fn` as is."""

    def loss(outputs, labels: torch.Tensor) -> torch.Tensor:
        if not isinstance(outputs, tuple):
            return loss_fn(outputs, labels)
        main, *ahead = outputs
        total = loss_fn(main, labels)
        if not ahead:
            return total
        extra = sum(loss_fn(o, labels_ahead(labels, k)) for k, o in enumerate(ahead, start=1))
        return total + (weight / len(ahead)) * extra

    return loss
