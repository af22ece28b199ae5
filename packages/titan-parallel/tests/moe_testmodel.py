"""A user's own mixture-of-experts transformer for titan-parallel's expert-parallel tests:
parallel_testmodel's attention, then a MoE feed-forward that follows `titan_core.MoEPlan`
(top-k softmax router with a load-balancing bias, stacked experts run by a loop over the
experts, one shared expert). No titan-models: this is what a user of titan-parallel alone
writes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from parallel_testmodel import Attention, TinyArgs
from torch import nn

from titan_core.init import ParamInit, canonical_name, init_from_plan_
from titan_core.protocols import MoEPlan, TPPlan


@dataclass
class MoEArgs(TinyArgs):
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 16
    shared: bool = True


class Router(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.top_k = a.top_k
        self.gate = nn.Linear(a.dim, a.num_experts, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).softmax(-1)
        experts = (scores + bias).topk(self.top_k, dim=-1).indices  # the bias picks, never weighs
        weights = scores.gather(-1, experts)
        return weights / weights.sum(-1, keepdim=True), experts


class Experts(nn.Module):
    """`num_experts` SwiGLUs stacked (experts, in, out); rows arrive sorted by expert."""

    def __init__(self, a: MoEArgs):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(a.num_experts, a.dim, a.expert_hidden))
        self.w2 = nn.Parameter(torch.empty(a.num_experts, a.expert_hidden, a.dim))
        self.w3 = nn.Parameter(torch.empty(a.num_experts, a.dim, a.expert_hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # The local shards: under expert parallel this rank's experts (and their hidden slice
        # under tensor parallel), and the rows it receives are theirs.
        w1, w2, w3 = (
            w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3)
        )
        outs = [
            (F.silu(rows @ w1[e]) * (rows @ w3[e])) @ w2[e]
            for e, rows in enumerate(x.split(counts.tolist()))
        ]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class SharedExpert(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.expert_hidden, bias=False)
        self.w2 = nn.Linear(a.expert_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.expert_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.args = a
        self.router = Router(a)
        self.experts = Experts(a)
        self.shared = SharedExpert(a) if a.shared else None
        self.register_buffer("bias", torch.zeros(a.num_experts))
        self.register_buffer("counts", torch.zeros(a.num_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts = self.router(tokens, self.bias)
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=self.args.num_experts)
        with torch.no_grad():
            self.counts += counts
        order = flat.argsort(stable=True)
        token_of = order // self.args.top_k
        routed = self.experts(tokens[token_of], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add(0, token_of, routed)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, dim)

    def moe_plan(self) -> MoEPlan:
        shared = {"shared.w1": "colwise", "shared.w3": "colwise", "shared.w2": "rowwise"}
        return MoEPlan(self.args.num_experts, shared_experts=shared if self.shared else {})


class Block(nn.Module):
    def __init__(self, a: MoEArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.attention = Attention(a)
        self.ffn_norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.feed_forward = MoE(a)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), scale)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyMoE(nn.Module):
    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, a: MoEArgs | None = None):
        super().__init__()
        self.args = a = a or MoEArgs()
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        scale = (self.args.dim // self.args.n_heads) ** -0.5
        for block in self.layers.values():
            h = block(h, scale)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_plan(self) -> dict[str, ParamInit]:
        """Initial values as data (a function of seed and name): every layout, pipeline stages
        included, starts from the weights one process draws."""
        plan = {
            canonical_name(name): (
                ParamInit("constant", value=1.0) if "norm" in name else ParamInit.truncated(0.1)
            )
            for name, _ in self.named_parameters()
        }
        return plan | {f"layers.{k}.feed_forward.bias": ParamInit("constant") for k in self.layers}

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        for moe in self.moe_layers():
            moe.counts = torch.zeros_like(moe.counts, device=buffer_device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        init_from_plan_(self, self.init_plan(), torch.initial_seed())
        self.init_buffers(buffer_device)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def balance_experts(self, group=None, coeff: float = 0.05) -> None:
        """After the optimizer step: each expert's bias moves towards even load, from the
        tokens counted on the ranks in `group` (every rank that saw other tokens)."""
        for moe in self.moe_layers():
            if group is not None:
                torch.distributed.all_reduce(moe.counts, group=group)
            moe.bias += coeff * torch.sign(moe.counts.mean() - moe.counts)
            moe.counts.zero_()

    def tp_plan(self) -> TPPlan:
        return TPPlan(
            root={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
            block={
                "attention_norm": "sequence_parallel",
                "attention": "block_input",
                "attention.wq": "colwise",
                "attention.wk": "colwise",
                "attention.wv": "colwise",
                "attention.wo": "rowwise",
                "ffn_norm": "sequence_parallel",
            },
            divisible_by_tp={"n_heads": self.args.n_heads},
        )

    def cp_buffers(self) -> dict[str, int]:
        return {}

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())
