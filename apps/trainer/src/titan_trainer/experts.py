"""The trainer's side of mixture-of-experts layers (`titan_core.MoELayer`: the modules in the
blocks that give `moe_plan()`, such as titan-models' `MoE`): after each optimizer step the expert biases move
towards even load, from the tokens every expert received on all the ranks that share the
weights, and routers with centering take the mean of those ranks' router inputs; the load of
every layer is reported as max / mean tokens per expert on the metric line and in TensorBoard;
a layer whose busiest expert stays above `COLLAPSE_RATIO` times the mean for `COLLAPSE_STEPS`
steps in a row is warned about once; and the auxiliary balance loss is weighed like the step's
loss under gradient accumulation. No token is ever dropped; under an expert capacity
(`[model] moe_capacity_factor`) the share of token-expert choices re-routed to a lower-ranked
expert is reported beside the load, since the capacity keeps the load even by construction and
only that share shows a router that still prefers a few experts."""

from __future__ import annotations

import torch
from torch import nn

import titan_parallel
from titan_core import MoELayer, ParallelDims, get_logger

log = get_logger("experts")

COLLAPSE_RATIO = 2.0
COLLAPSE_STEPS = 20

COLLAPSE_WARNING = (
    "experts: in %s the busiest expert has taken more than %.1f times the mean load for %d "
    "steps in a row (max/mean %.2f now): the router is sending most tokens to a few experts, "
    "and the others barely train.\n"
    "  Set --model.moe_router_centering true (the router reads its input less the last step's "
    "mean) and --model.moe_capacity_factor 1.25 (each expert takes at most 1.25 times its "
    "share, the rest re-routed), raise --model.moe_aux_loss_alpha (the auxiliary balance loss) or "
    "--model.moe_load_balance_coeff (the expert-bias step), or lower --optimizer.lr."
)


def _moe_layers(part: nn.Module) -> list[tuple[str, MoELayer]]:
    """(name, layer) of each mixture-of-experts layer in the part's blocks: the modules that
    give a `moe_plan()`, found as expert parallel finds them."""
    return [(name, layer) for name, layer, _ in titan_parallel.moe_layers(part)]


class ExpertLoad:
    def __init__(self, parts: list[nn.Module], dims: ParallelDims, accum: int):
        """`accum`: forward passes per optimizer step over which the auxiliary loss's
        gradient adds up (accumulated microbatches times pipeline microbatches)."""
        named = [(name, m) for part in parts for name, m in _moe_layers(part)]
        self.layers = [m for _, m in named]
        # "layers.3.moe" -> "layers.3": the block, as the model's state dict names it.
        self.names = [name.rsplit(".", 1)[0] if "." in name else name for name, _ in named]
        self.group = None
        if self.layers and dims.world_size > 1 and (mesh := dims.mesh("dp_cp")) is not None:
            self.group = mesh.get_group()  # the ranks with the same experts and other tokens
        for layer in self.layers:
            layer.aux_loss_scale = 1.0 / accum  # each microbatch's loss is scaled so
        self._worst: torch.Tensor | None = None  # per layer, the highest since the last read
        self._streak: torch.Tensor | None = None  # per layer, steps in a row above the ratio
        self._longest: torch.Tensor | None = None  # per layer, the longest such streak
        self._last = torch.zeros(0)
        self._warned = False
        # Per layer, re-routed and all token-expert choices since the last read.
        self._rerouted: torch.Tensor | None = None
        self._chosen: torch.Tensor | None = None
        self.capped = any(m.args.capacity_factor for m in self.layers)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def after_step(self) -> None:
        """Move the biases and note this step's max/mean load per layer (on the device: no
        host read)."""
        sums = [layer.step_sums() for layer in self.layers]  # counts (and router inputs)
        counts = torch.cat(sums)
        if self.capped:
            rerouted = torch.stack([layer.tokens_rerouted for layer in self.layers])
            counts = torch.cat([counts, rerouted.to(counts.dtype)])
        if self.group is not None:  # one all-reduce for every layer
            torch.distributed.all_reduce(counts, group=self.group)
        ratios, chosen = [], []
        sizes = [s.numel() for s in sums]
        if self.capped:
            counts, rerouted = counts[: sum(sizes)], counts[sum(sizes) :]
        for layer, summed in zip(self.layers, counts.split(sizes)):
            mine = layer.update_expert_bias(sums=summed)
            chosen.append(mine.sum())
            ratios.append(mine.max() / mine.mean().clamp_min(1))
        ratio = torch.stack(ratios).float()
        above = (ratio > COLLAPSE_RATIO).float()
        if self._streak is None or self._longest is None:
            self._streak, self._longest = above, above.clone()
        else:
            self._streak = (self._streak + 1) * above
            self._longest = torch.maximum(self._longest, self._streak)
        self._worst = ratio if self._worst is None else torch.maximum(self._worst, ratio)
        self._last = ratio
        if self.capped:
            chosen = torch.stack(chosen).to(rerouted.dtype)
            if self._rerouted is not None and self._chosen is not None:  # add to the window's
                rerouted, chosen = self._rerouted + rerouted, self._chosen + chosen
            self._rerouted, self._chosen = rerouted, chosen

    def read_rerouted(self) -> dict[str, float] | None:
        """Under an expert capacity, each layer's share (0-1) of token-expert choices re-routed
        since the last read, by block name (one host read); None without a capacity."""
        if self._rerouted is None or self._chosen is None:
            return None
        share = (self._rerouted / self._chosen.clamp_min(1)).tolist()
        self._rerouted = self._chosen = None
        return dict(zip(self.names, share))

    def read(self) -> dict[str, float] | None:
        """Each layer's highest max/mean tokens per expert since the last read (one host read),
        by block name; warns once when a layer has stayed above `COLLAPSE_RATIO` for
        `COLLAPSE_STEPS` steps in a row."""
        if self._worst is None or self._longest is None:
            return None
        worst, longest, last = torch.stack([self._worst, self._longest, self._last]).tolist()
        self._worst = None
        if not self._warned:
            for name, steps, now in zip(self.names, longest, last):
                if steps >= COLLAPSE_STEPS:
                    self._warned = True
                    log.warning(COLLAPSE_WARNING, name, COLLAPSE_RATIO, COLLAPSE_STEPS, now)
                    break
        return dict(zip(self.names, worst))
