"""Token dispatch and combine for expert parallel: send each routed token copy to the rank that
holds its expert, and the experts' results back, with all-to-all over the expert-parallel group.

The experts are split evenly: with `ep` ranks and `E` experts, rank r holds experts
r*E/ep .. (r+1)*E/ep - 1. A layer hands over its routed copies sorted by expert, with the
count per expert; since consecutive experts live on consecutive ranks, the rows for each rank
are one contiguous slice, so one all-to-all sends them. How many rows arrive from each rank is
not known in advance (it depends on the routing), so the counts are exchanged first (a small
all-to-all) and read on the host once, to size the buffers; there is no capacity limit and no
token is dropped. The rows a rank receives come grouped by sender; they are reordered so that
each local expert's rows are contiguous (the layout grouped matmul wants), and put back in
arrival order before the results return. Everything is differentiable: backward sends the
gradients the same ways in reverse (`torch.distributed._functional_collectives`). It runs on
gloo and NCCL.

Under fake tensors (a dry run) the counts have no values: the exchange assumes every rank sends
an equal share of its rows to every rank (perfectly balanced experts), which is what the memory
of a balanced step needs; an imbalanced step receives more rows on the busiest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._subclasses.fake_tensor import is_fake


@dataclass
class Exchange:
    """What `combine` needs to undo one `dispatch`."""

    group: dist.ProcessGroup
    send_splits: list[int]
    recv_splits: list[int]
    by_expert: torch.Tensor
    """Received row positions in local-expert order (the rows the experts see)."""


def dispatch(
    x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """Rows `x` sorted by global expert (`counts[e]` of them for expert e) -> the rows this rank's
    experts must process, sorted by local expert, their counts, and the `Exchange` to combine."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    if is_fake(counts):
        return _balanced(x, counts, group, ep, local)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    per_rank = torch.stack([counts.view(ep, local).sum(1), received.view(ep, local).sum(1)])
    send_splits, recv_splits = per_rank.tolist()  # one host read for both
    rows = funcol.all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
    # Received rows come in (sender, local expert) blocks; each local expert's rows together.
    expert_of_block = torch.arange(ep * local, device=counts.device).remainder(local)
    expert_of_row = torch.repeat_interleave(expert_of_block, received, output_size=sum(recv_splits))
    by_expert = expert_of_row.argsort(stable=True)
    local_counts = received.view(ep, local).sum(0)
    return (
        rows.index_select(0, by_expert),
        local_counts,
        Exchange(group, send_splits, recv_splits, by_expert),
    )


def combine(y: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """The experts' results `y` (in the order `dispatch` gave their inputs) -> one row per row
    the layer dispatched, in its order, on the rank that sent it."""
    arrival = torch.empty_like(exchange.by_expert)
    arrival[exchange.by_expert] = torch.arange(arrival.numel(), device=arrival.device)
    back = y.index_select(0, arrival)
    return funcol.all_to_all_single_autograd(
        back.contiguous(), exchange.send_splits, exchange.recv_splits, exchange.group
    )


def _balanced(
    x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, ep: int, local: int
) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
    """The simulated exchange (fake tensors): every rank sends and receives equal shares."""
    n = x.shape[0]
    splits = [n // ep + (1 if r < n % ep else 0) for r in range(ep)]
    rows = funcol.all_to_all_single_autograd(x.contiguous(), splits, splits, group)
    by_expert = torch.arange(n, device=x.device)
    local_counts = counts.new_zeros(local)
    return rows.index_select(0, by_expert), local_counts, Exchange(group, splits, splits, by_expert)
