"""The mixture-of-experts feed-forward: route each token to its top-k experts, run every expert
on its tokens (sorted so that each expert's are contiguous), add the results back weighted by
the router, plus the shared experts every token goes through.

Load balancing, both from DeepSeek-V3 (arXiv:2412.19437, section 2.1.2):
- auxiliary-loss-free: each expert has a selection bias (`expert_bias`, saved with the model);
  the tokens each expert received in training are counted (`tokens_per_expert`; validation
  and generation are not) and, once per optimizer step, `update_expert_bias()` moves every
  bias by `load_balance_coeff` towards even load (up for an expert below the mean, down
  above it);
- auxiliary loss (`aux_loss_alpha`): alpha * sum_i f_i * P_i, f_i the share of the top-k
  choices that went to expert i (times num_experts / top_k, so 1 at even load), P_i the mean of
  its normalised score; per sequence and averaged (`aux_loss_type = "sequence"`, DeepSeek-V3's
  sequence-wise loss) or over every token of the microbatch (`"batch"`, the batch-level loss of
  Qwen3-MoE and Mixtral; Hugging Face's `load_balancing_loss_func` is this times top_k). It
  adds no output: its gradient is added in the backward
  pass of this layer (`aux_loss_scale` weighs it, e.g. 1/N under N accumulated microbatches),
  and its last value is kept in `aux_loss` for logging.
Router centering (`router_centering`, see `titan_models.moe.router`): the router reads its
input less `router_center`, which `update_expert_bias()` sets to the mean of the router inputs
summed since the last call (`router_input_sum`, training forwards only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import MoEPlan
from titan_models.moe.args import MoEArgs
from titan_models.moe.experts import GroupedExperts
from titan_models.moe.router import TopKRouter


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def swiglu_init_plan(std: float, out_std: float) -> dict[str, ParamInit]:
    """How a `SwiGLU` starts, by name relative to it: `std` for w1 and w3 (they read the
    input), `out_std` for w2 (it writes into the residual stream)."""
    plan = {n: ParamInit.truncated(std) for n in ("w1.weight", "w3.weight")}
    return plan | {"w2.weight": ParamInit.truncated(out_std)}


def moe_init_plan(args: MoEArgs, std: float, out_std: float) -> dict[str, ParamInit]:
    """How a `MoE` of these args starts, by name relative to it (see `MoE.init_plan`), from
    the args alone: a model's plan names the layers a pipeline stage does not hold too."""
    plan = {n: ParamInit.truncated(std) for n in ("router.gate.weight", "experts.w1", "experts.w3")}
    plan["experts.w2"] = ParamInit.truncated(out_std)
    zero = ParamInit("constant", value=0.0)
    if args.router_bias:
        plan["router.gate.bias"] = zero
    if args.expert_biases:
        plan |= {"experts.b1": zero, "experts.b3": zero, "down_bias": zero}
    if args.num_shared_experts:
        plan |= {f"shared_experts.{n}": p for n, p in swiglu_init_plan(std, out_std).items()}
    return plan


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        if problems := args.problems(dim):
            raise ValueError("MoEArgs: " + "; ".join(problems))
        self.args = args
        self.router = TopKRouter(dim, args)
        self.experts = GroupedExperts(
            dim,
            args.hidden_dim,
            args.num_experts,
            args.use_grouped_mm,
            biases=args.expert_biases,
            activation=args.activation,
            limit=args.swiglu_limit,
            alpha=args.swiglu_alpha,
        )
        # The down projection's bias, per expert: added here, weighted as the outputs are,
        # so that under tensor parallel (each rank a partial sum of w2's product) it counts once.
        self.down_bias = (
            nn.Parameter(torch.empty(args.num_experts, dim)) if args.expert_biases else None
        )
        self.shared_experts = (
            SwiGLU(dim, args.hidden_dim * args.num_shared_experts)
            if args.num_shared_experts
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        if args.router_centering:  # saved (state: the routing depends on it); the sum not
            self.register_buffer("router_center", torch.zeros(dim))
            self.register_buffer("router_input_sum", torch.zeros(dim), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # Token-expert choices a capacity re-routed since the last bias update (training).
        self.register_buffer("tokens_rerouted", torch.zeros(()), persistent=False)
        self.aux_loss_scale = 1.0
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        bias = self.expert_bias if a.load_balance_coeff is not None else None
        center = self.router_center if a.router_centering else None
        weights, experts, scores = self.router(tokens, bias, batch, center)
        flat = experts.flatten()  # token t's choices at t*k .. t*k+k-1
        # Tokens per expert, with a shape known before the data (fake tensors, compile).
        counts = torch.zeros(a.num_experts, dtype=torch.int64, device=flat.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        if self.training:  # the load of training steps: validation neither moves the bias
            with torch.no_grad():  # nor shows in the step's load
                self.tokens_per_expert += counts
                if self.router.rerouted is not None:
                    self.tokens_rerouted += self.router.rerouted
                if a.router_centering:
                    self.router_input_sum += tokens.float().sum(0)
        order = flat.argsort(stable=True)  # every expert's tokens together, in expert order
        token_of = order // a.top_k
        weight_of = weights.flatten()[order].unsqueeze(-1)
        if a.score_before_experts:
            routed = self.experts(tokens[token_of] * weight_of.to(tokens.dtype), counts)
        else:
            routed = self.experts(tokens[token_of], counts)
            routed = routed * weight_of.to(routed.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of, routed.to(tokens.dtype))
        if self.down_bias is not None:  # sum over a token's experts of weight x bias
            picked = self.down_bias[experts].float() * weights.unsqueeze(-1)
            out = out + picked.sum(1).to(out.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if a.aux_loss_alpha > 0 and torch.is_grad_enabled():
            rows = batch if a.aux_loss_type == "sequence" else 1
            loss = self._aux_loss(
                scores.view(rows, -1, a.num_experts), experts.view(rows, -1, a.top_k)
            )
            self.aux_loss = loss.detach()
            out = _AddGradientOf.apply(out, loss * self.aux_loss_scale)
        return out.view(batch, seq, dim)

    def _aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`scores` (R, S, E) and `experts` (R, S, k): balance measured within each of R rows
        (sequences, or one row of every token), averaged over the rows."""
        a = self.args
        _, seq, _ = scores.shape
        chosen = torch.zeros_like(scores).scatter_(-1, experts, 1.0)  # (B, S, E), k ones per token
        f = chosen.sum(1) * (a.num_experts / (a.top_k * seq))  # (B, E), no gradient
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)  # (B, E)
        return a.aux_loss_alpha * (f * p).sum(-1).mean()

    def moe_plan(self) -> MoEPlan:
        """How expert and tensor parallel may split this layer (titan-parallel reads it): the
        routed experts stacked along dimension 0 and called as experts(x, counts); w1/w3 split
        along their outputs and w2 along its inputs under TP; the routing weights scale the
        experts' outputs, or their inputs with `score_before_experts` (Llama 4)."""
        shared = (
            {"shared_experts.w1": "colwise", "shared_experts.w3": "colwise", "shared_experts.w2": "rowwise"}
            if self.shared_experts is not None
            else {}
        )  # fmt: skip
        weights = {"w1": "colwise", "w3": "colwise", "w2": "rowwise"}
        if self.args.expert_biases:
            weights |= {"b1": "colwise", "b3": "colwise"}
        return MoEPlan(
            num_experts=self.args.num_experts,
            expert_weights=weights,
            shared_experts=shared,
            weights_scale_outputs=not self.args.score_before_experts,
        )

    def init_plan(self, std: float, out_std: float) -> dict[str, ParamInit]:
        """How this layer's parameters start, by name relative to it: `std` for what reads the
        input (router, w1, w3), `out_std` for what writes into the residual stream (w2). The
        expert bias, a buffer saved with the weights, starts at zero: a model's plan names it
        too (`init_from_plan_` fills the buffers a plan names)."""
        return moe_init_plan(self.args, std, out_std)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """After `to_empty`: no tokens counted since the last bias update yet; the expert bias
        (state, from the init plan or a checkpoint) keeps its values, moved to `buffer_device`
        (default: where it is)."""
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert, device=buffer_device)
        self.tokens_rerouted = torch.zeros_like(self.tokens_rerouted, device=buffer_device)
        if self.args.router_centering:
            self.router_input_sum = torch.zeros_like(self.router_input_sum, device=buffer_device)
        if buffer_device is not None:
            self.expert_bias = self.expert_bias.to(buffer_device)
            if self.args.router_centering:
                self.router_center = self.router_center.to(buffer_device)

    def step_sums(self) -> torch.Tensor:
        """What the tokens since the last bias update add up to, for the caller to sum over
        the ranks that share this layer's weights: the tokens per expert, then (with router
        centering) the sum of the router's inputs."""
        if not self.args.router_centering:
            return self.tokens_per_expert
        return torch.cat([self.tokens_per_expert, self.router_input_sum])

    @torch.no_grad()
    def update_expert_bias(self, group=None, *, sums: torch.Tensor | None = None) -> torch.Tensor:
        """After the optimizer step: move each expert's selection bias towards even load, from
        the tokens counted since the last call, set the router's center to the mean of their
        router inputs (router centering; kept when no token came), and start counting again.
        What is counted is `step_sums()`, summed here over `group` (e.g. the data-parallel
        process group, so that every rank moves alike) or given summed by the caller (`sums`).
        Returns the tokens per expert."""
        if sums is None:
            sums = self.step_sums().clone()
            if group is not None:
                torch.distributed.all_reduce(sums, group=group)
        counts, input_sum = sums[: self.args.num_experts], sums[self.args.num_experts :]
        if self.args.load_balance_coeff is not None:
            delta = torch.sign(counts.mean() - counts) * self.args.load_balance_coeff
            self.expert_bias.add_(delta.to(self.expert_bias.dtype))
        if self.args.router_centering:
            tokens = counts.sum() / self.args.top_k  # no host read: where, not if
            mean = input_sum / tokens.clamp_min(1)
            self.router_center.copy_(torch.where(tokens > 0, mean, self.router_center))
            self.router_input_sum.zero_()
        self.tokens_per_expert.zero_()
        self.tokens_rerouted.zero_()
        return counts


class _AddGradientOf(torch.autograd.Function):
    """Returns `out` unchanged; in the backward pass, `loss` gets gradient 1, so that its
    gradient is added to the parameters' without being part of the model's output."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)
