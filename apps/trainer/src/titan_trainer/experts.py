"""The trainer's side of mixture-of-experts layers (any module with `update_expert_bias`, such
as titan-models' `MoE`): after each optimizer step the expert biases move towards even load,
from the tokens every expert received on all the ranks that share the weights; the load is
reported as max / mean tokens per expert (worst layer) on the metric line; and the auxiliary
balance loss is weighed like the step's loss under gradient accumulation. No token is ever
dropped (no capacity limit), so there is nothing else to report."""

from __future__ import annotations

import torch
from torch import nn

from titan_core import ParallelDims


class ExpertLoad:
    def __init__(self, parts: list[nn.Module], dims: ParallelDims, accum: int):
        """`accum`: forward passes per optimizer step over which the auxiliary loss's
        gradient adds up (accumulated microbatches times pipeline microbatches)."""
        self.layers = [
            m for part in parts for m in part.modules() if hasattr(m, "update_expert_bias")
        ]
        self.group = None
        if self.layers and (mesh := dims.mesh("dp_cp")) is not None:
            self.group = mesh.get_group()  # the ranks with the same experts and other tokens
        for layer in self.layers:
            layer.aux_loss_scale = 1.0 / accum  # each microbatch's loss is scaled so
        self._worst: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return bool(self.layers)

    def after_step(self) -> None:
        """Move the biases and note this step's worst max/mean load (on the device)."""
        counts = torch.cat([layer.tokens_per_expert for layer in self.layers])
        if self.group is not None:  # one all-reduce for every layer
            torch.distributed.all_reduce(counts, group=self.group)
        ratios = []
        sizes = [layer.tokens_per_expert.numel() for layer in self.layers]
        for layer, mine in zip(self.layers, counts.split(sizes)):
            layer.update_expert_bias(counts=mine)
            ratios.append(mine.max() / mine.mean().clamp_min(1))
        worst = torch.stack(ratios).max()
        self._worst = worst if self._worst is None else torch.maximum(self._worst, worst)

    def read(self) -> float | None:
        """The worst layer's max/mean tokens per expert since the last read (one host read)."""
        if self._worst is None:
            return None
        value, self._worst = float(self._worst), None
        return value
