"""Token-choice top-k routing: which experts each token goes to, and with what weight.

Scores are a softmax over the experts or a sigmoid per expert. A per-expert `bias` (the
auxiliary-loss-free balancing of DeepSeek-V3, arXiv:2412.19437 section 2.1.2) shifts which
experts are *chosen*, never the weights the chosen ones get. Group-limited routing (the same
paper, and DeepSeek-V2) first keeps the `top_k_groups` best groups of experts per token, a
group ranked by the sum of its two best scores (its best one when groups have one expert).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_models.moe.args import MoEArgs


class TopKRouter(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens `x` (T, dim): (weights (T, k), experts (T, k), scores (T, E)), the scores
        being every expert's, before the bias (for the auxiliary loss)."""
        a = self.args
        logits = self.gate(x).float()  # routing in float32: ties and sums stay exact enough
        if a.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias.float()
        if a.num_groups > 1:
            choice = self._limit_to_groups(choice)
        experts = choice.topk(a.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, experts)
        if a.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, experts, scores

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's best groups set to -inf."""
        a = self.args
        grouped = choice.unflatten(-1, (a.num_groups, -1))  # (T, groups, experts per group)
        best = min(2, grouped.shape[-1])
        group_score = grouped.topk(best, dim=-1).values.sum(-1)
        keep = group_score.topk(a.top_k_groups, dim=-1).indices
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(-1, keep, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(-2)
