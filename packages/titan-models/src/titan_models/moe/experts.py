"""The routed experts: `num_experts` SwiGLU feed-forwards stored as three stacked weights, run
on tokens already sorted by expert.

Two ways to run them, with the same weights and the same result: one grouped matmul per weight
(`torch._grouped_mm`, each expert multiplying its own contiguous block of rows; it runs on CPU
and on CUDA GPUs of compute capability 9.0 and later) or a Python loop over the experts (the
reference the grouped path is tested against, and the fallback elsewhere). No capacity limit:
every token reaches every expert it was routed to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class GroupedExperts(nn.Module):
    """`num_experts` gated feed-forwards, w2(act(x w1 [+ b1], x w3 [+ b3])), with `act`
    silu(gate) * up (`swiglu`) or GPT-OSS's `clamped_swiglu` (see `MoEArgs.activation`);
    the biases with `biases` (the down projection's is the layer's, `MoE.down_bias`)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        use_grouped_mm: bool = True,
        *,
        biases: bool = False,
        activation: str = "swiglu",
        limit: float = 7.0,
        alpha: float = 1.702,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.activation, self.limit, self.alpha = activation, limit, alpha
        # x @ w: rows are tokens, so each expert's matrices are (in, out).
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if biases:
            self.b1 = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.b3 = nn.Parameter(torch.empty(num_experts, hidden_dim))
        else:
            self.b1 = self.b3 = None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`x` (N, dim): tokens sorted by expert, `counts[e]` of them for expert e."""
        if self.use_grouped_mm:
            return self._grouped(x, counts)
        return self._loop(x, counts)

    def _gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = counts.cumsum(0, dtype=torch.int32)  # where each expert's rows end
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        x = x.to(w1.dtype)
        gate, up = torch._grouped_mm(x, w1, offs=offsets), torch._grouped_mm(x, w3, offs=offsets)
        if self.b1 is not None:
            expert = torch.repeat_interleave(
                torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0]
            )
            gate, up = gate + _local(self.b1)[expert], up + _local(self.b3)[expert]
        return torch._grouped_mm(self._gate(gate, up), w2, offs=offsets)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        x = x.to(w1.dtype)
        outs = []
        for e, rows in enumerate(x.split(counts.tolist())):  # one host read of the counts
            gate, up = rows @ w1[e], rows @ w3[e]
            if self.b1 is not None:
                gate, up = gate + _local(self.b1)[e], up + _local(self.b3)[e]
            outs.append(self._gate(gate, up) @ w2[e])
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


def _local(w: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor: under expert parallel each rank holds whole experts (its
    local shard of dimension 0), and the tokens it receives are for those experts only; under
    tensor parallel its slice of every expert's hidden features."""
    return w.to_local() if isinstance(w, DTensor) else w
