"""Token-choice top-k routing: which experts each token goes to, and with what weight.

Scores are a softmax over the experts or a sigmoid per expert. A per-expert `bias` (the
auxiliary-loss-free balancing of DeepSeek-V3, arXiv:2412.19437 section 2.1.2) shifts which
experts are *chosen*, never the weights the chosen ones get. Group-limited routing (the same
paper, and DeepSeek-V2) first keeps the `top_k_groups` best groups of experts per token, a
group ranked by the sum of its two best scores (its best one when groups have one expert).

Two training-only choices balance the experts within the current batch, each sequence on its
own (so the choice does not depend on how sequences are spread over ranks), while the weights
stay the family's scores of the chosen experts, so the router learns as before:
- Sinkhorn selection (`router_selection = "sinkhorn"`, Megatron-LM's `sinkhorn` balancing,
  S-BASE of Clark et al. 2022, arXiv:2202.01169): each token ranks the experts by its logits
  plus a per-expert offset such that exp(logits + offset), normalised per token, gives every
  expert the same share of the sequence (Sinkhorn's alternate row and column normalisation,
  in the log domain, without gradient). A direction common to all tokens, which makes a plain
  top-k send them all to one expert, is cancelled.
  The offsets come from the whole sequence, later tokens included: like Megatron's, it is
  not causal in training (a token's experts, not its computation, depend on later tokens).
- Expert capacity (`capacity_factor`): an expert takes at most factor x its even share of a
  sequence's top-k choices, first come, first served along the sequence; a token that finds
  its expert full goes to its next-ranked expert with room (re-routed, never dropped), under
  group limits one outside its best groups only once theirs are full. Causal: a token's
  experts depend only on the tokens before it. Soft balance alone does not make the hard
  top-k even (tokens that vary along few directions reach only a few experts' top-k); the
  capacity does, by construction.
In eval mode (validation, generation, what Hugging Face exports run) routing is the plain
top-k of the scores (plus the bias).

Router centering (`router_centering`, the debug flavors') subtracts a `center` from every
token before the gate, in training and eval alike: the mean router input of the last
training step (`MoE.router_center`). A direction every token shares adds, through the gate,
the same per-expert logit to every token; once it outgrows the tokens' differences (as the
residual stream of a small model does early in training at a high learning rate), the plain
top-k sends every token to the same experts, a collapse no balancing that acts on the next
steps can follow. Subtracted, it leaves the gate the tokens' differences, the way DINO
(Caron et al. 2021, arXiv:2104.14294) centers its teacher's outputs with a running mean to
keep one dimension from taking every sample; here the running mean is the last step's (a
slower one lags the drift of the residual stream: in the Qwen3 debug flavor at step 20 the
capacity re-routes 48% of the worst layer's choices at momentum 0.9, 13% at the last step's).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.moe.args import MoEArgs


class TopKRouter(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)
        # Under a capacity, how many of the last training forward's token-expert choices were
        # re-routed (not among the token's plain top-k): a router that still prefers a few
        # experts shows here, since the capacity keeps its load even.
        self.rerouted: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        sequences: int = 1,
        center: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens `x` (T, dim), `sequences` sequences of T / sequences tokens one after the
        other: (weights (T, k), experts (T, k), scores (T, E)), the scores being every
        expert's, before the bias (for the auxiliary loss). `center` (dim,): subtracted from
        every token before the gate (router centering)."""
        a = self.args
        if center is not None:  # in float32: the tokens' differences are a small part of them
            x = (x.float() - center.float()).to(x.dtype)
        logits = self.gate(x).float()  # routing in float32: ties and sums stay exact enough
        scores = self._score(logits)
        if a.router_selection == "sinkhorn" and self.training:
            choice = self._score(logits + sinkhorn_offsets(logits, sequences, a.sinkhorn_iters))
        else:
            choice = scores if bias is None else scores + bias.float()
        capped = a.capacity_factor is not None and self.training
        if a.num_groups > 1:
            outside = self._outside_best_groups(choice)
            if capped:  # the other groups only once the best groups' experts are full
                choice = choice - outside * _below_every_score(choice)
            else:
                choice = choice.masked_fill(outside, float("-inf"))
        if capped:
            experts = _on_local(choice, lambda c: self._with_capacity(c, sequences))
        else:
            experts = choice.topk(a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores

    def _score(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(dim=-1) if self.args.score_func == "softmax" else logits.sigmoid()

    def _with_capacity(self, choice: torch.Tensor, sequences: int) -> torch.Tensor:
        a = self.args
        per_sequence = choice.unflatten(0, (sequences, -1))
        even = per_sequence.shape[1] * a.top_k / a.num_experts
        capacity = math.ceil(a.capacity_factor * even)
        experts = top_k_within_capacity(per_sequence, a.top_k, capacity).flatten(0, 1)
        with torch.no_grad():
            plain = choice.topk(a.top_k, dim=-1, sorted=False).indices
            kept = (experts.unsqueeze(-1) == plain.unsqueeze(-2)).any(-1)
            self.rerouted = (~kept).sum()
        return experts

    def _outside_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """(T, E), True for the experts outside each token's best groups."""
        a = self.args
        grouped = choice.unflatten(-1, (a.num_groups, -1))  # (T, groups, experts per group)
        best = min(2, grouped.shape[-1])
        group_score = grouped.topk(best, dim=-1).values.sum(-1)
        keep = group_score.topk(a.top_k_groups, dim=-1).indices
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(-1, keep, False)
        return mask.unsqueeze(-1).expand_as(grouped).flatten(-2)


def _below_every_score(choice: torch.Tensor) -> torch.Tensor:
    """A shift that, subtracted from some of `choice`'s scores, ranks them after every
    unshifted one while keeping their order (finite, unlike -inf, so they stay choosable)."""
    return (choice.max() - choice.min()).detach() + 1.0


def _on_local(t: torch.Tensor, fn) -> torch.Tensor:
    """fn(t) computed on the local tensor of a replicated DTensor (the router under tensor
    parallel runs alike on every rank), returned as one again; fn(t) for a plain tensor."""
    if not isinstance(t, DTensor):
        return fn(t)
    return DTensor.from_local(fn(t.to_local()), t.device_mesh, t.placements, run_check=False)


@torch.no_grad()
def sinkhorn_offsets(logits: torch.Tensor, sequences: int, iters: int) -> torch.Tensor:
    """Offsets (T, E) to add to `logits` (T, E) so that, within each of `sequences` consecutive
    sequences, exp(logits + offset) normalised per token sums to the same total for every
    expert (`iters` Sinkhorn iterations in the log domain: exact for logits of any size). Only
    the per-expert (column) potential is returned, broadcast over its sequence's tokens: a
    per-token constant would not change how a token ranks the experts."""
    cost = logits.float().unflatten(0, (sequences, -1))  # (S, T/S, E)
    col = torch.zeros_like(cost[:, :1, :])  # (S, 1, E)
    for _ in range(iters):
        row = -(cost + col).logsumexp(-1, keepdim=True)  # every token's row sums to 1
        col = -(cost + row).logsumexp(-2, keepdim=True)  # every expert's column to 1
    return col.expand_as(cost).flatten(0, 1)


@torch.no_grad()
def top_k_within_capacity(choice: torch.Tensor, k: int, capacity: int) -> torch.Tensor:
    """For `choice` (S, T, E), each of S sequences' tokens ranking the experts: every token's k
    experts (S, T, k), first come, first served: token t takes its k best experts among those
    its sequence's tokens before it have not filled to `capacity`, so its choice depends on
    no later token (training stays causal). Should fewer than k experts have room (possible
    only at the sequence's end), it takes full ones, by rank. A loop over the positions,
    each step a top-k over (S, E): meant for few experts and debug-size sequences."""
    seqs, tokens, experts = choice.shape
    # The first `capacity` tokens cannot find an expert full: their plain top-k, at once.
    free = min(capacity, tokens)
    chosen = [choice[:, :free].topk(k, dim=-1, sorted=False).indices]
    load = torch.zeros(seqs, experts, dtype=torch.long, device=choice.device)
    load.scatter_add_(1, chosen[0].flatten(1), torch.ones_like(chosen[0].flatten(1)))
    full_margin = _below_every_score(choice)
    ones = torch.ones(seqs, k, dtype=torch.long, device=choice.device)
    for t in range(free, tokens):
        ranked = choice[:, t] - (load >= capacity) * full_margin  # full experts last
        picked = ranked.topk(k, dim=-1, sorted=False).indices
        load.scatter_add_(1, picked, ones)
        chosen.append(picked.unsqueeze(1))
    return torch.cat(chosen, 1)
