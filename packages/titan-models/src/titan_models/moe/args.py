"""What a mixture-of-experts feed-forward is made of: one dataclass, shared by every family that
uses the layer (Qwen3-MoE, DeepSeek-V3, Llama 4)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, TypeVar


@dataclass
class MoEArgs:
    num_experts: int = 8
    """Routed experts."""
    top_k: int = 2
    """Experts each token is sent to."""
    hidden_dim: int = 256
    """Hidden size of each expert's SwiGLU."""
    num_shared_experts: int = 0
    """Experts every token goes through (DeepSeek, Llama 4): one SwiGLU of this many times
    `hidden_dim`."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Softmax over the experts (Qwen3-MoE, Mixtral) or a sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = False
    """Divide the chosen experts' scores by their sum (Qwen3's norm_topk_prob)."""
    route_scale: float = 1.0
    """Multiply the routing weights by this (DeepSeek-V3's routed_scaling_factor)."""
    score_before_experts: bool = False
    """Multiply each token by its routing weight before the expert instead of multiplying the
    expert's output (Llama 4); the same for a linear expert, not for a SwiGLU."""
    num_groups: int = 1
    """Group-limited routing (DeepSeek-V3): the experts split into this many groups..."""
    top_k_groups: int = 1
    """...of which each token may use only the best this many (by the sum of each group's
    two best scores)."""
    load_balance_coeff: float | None = 1e-3
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each optimizer step every
    expert's selection bias moves by this much towards even load. None turns it off. It acts
    on the scores, so it suits sigmoid scores (DeepSeek-V3's); a peaked softmax hardly moves."""
    aux_loss_alpha: float = 0.0
    """Weight of the auxiliary balance loss; 0: none."""
    aux_loss_type: Literal["sequence", "batch"] = "sequence"
    """Over what the auxiliary loss measures balance: each sequence (DeepSeek-V3's
    sequence-wise loss) or all the tokens of the microbatch (the batch-level loss of Qwen3-MoE,
    Mixtral and Hugging Face's `load_balancing_loss_func`). The batch-level loss is taken over
    each rank's microbatch, as Hugging Face and Megatron take it by default, so its value and
    gradient depend on the data-parallel layout; the sequence-wise one does not."""
    router_selection: Literal["topk", "sinkhorn"] = "topk"
    """How training ranks each token's experts: `topk`, by score (plus the expert bias), as
    every family's reference; `sinkhorn`, by logits Sinkhorn-balanced over the tokens of each
    sequence (Megatron-LM's `sinkhorn` balancing, S-BASE; see `titan_models.moe.router`):
    not causal (a token's experts depend on later tokens of its sequence), and alone it does
    not hold a bound on the load. The weights stay the chosen experts' scores; eval and
    generation rank by score. Not with the expert bias (Sinkhorn balances every step)."""
    sinkhorn_iters: int = 8
    """Sinkhorn iterations of `router_selection = "sinkhorn"`."""
    capacity_factor: float | None = None
    """In training, an expert takes at most this times its even share of each sequence's
    choices (tokens x top_k / num_experts, rounded up), first come, first served along the
    sequence; a token that finds its expert full goes to its next-ranked one with room
    (re-routed, not dropped), so a layer's max/mean load stays at or under it, and a token's
    experts depend on no later token. With group limits, a token goes outside its best
    groups only once their experts are full. Each sequence on its own: the choice does not
    depend on the data-parallel, expert-parallel or pipeline layout; under context parallel
    each rank limits its own part of the sequence. A loop over the sequence's positions per
    layer: meant for debug-size models. None: no limit (eval and generation never limit)."""
    router_centering: bool = False
    """Subtract from the router's input the mean router input of the last training step
    (every data-parallel rank's tokens, set after each optimizer step, zero before the
    first): a direction that every token shares, which grows in the residual stream early in
    training, then adds the same logit to every token and does not pick its experts. In
    training, validation and generation alike (a token's experts depend on no later token);
    the mean is a buffer saved with the model (`router_center`), which Hugging Face's formats
    have no place for (export refused once it is non-zero). Not a reference's scheme: the
    debug flavors' (trainer README, "Mixture of experts")."""
    router_bias: bool = False
    """The router's gate has a bias (GPT-OSS)."""
    expert_biases: bool = False
    """Each expert's three projections have biases (GPT-OSS): the gate and up ones in the
    experts (`b1`, `b3`), the down one in the layer (`down_bias`, added as the routing
    weights combine the experts' outputs, so that tensor parallel adds it once)."""
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """The experts' gated unit: silu(gate) * up, or GPT-OSS's clamped form,
    gate * sigmoid(swiglu_alpha * gate) * (up + 1) with gate clamped above at
    `swiglu_limit` and up to +-`swiglu_limit`."""
    swiglu_limit: float = 7.0
    """`clamped_swiglu`'s clamp."""
    swiglu_alpha: float = 1.702
    """`clamped_swiglu`'s sigmoid slope."""
    use_grouped_mm: bool = True
    """Run the experts through one grouped matmul (`torch._grouped_mm`); False: a loop over
    experts (the reference, and the fallback where grouped matmul does not run)."""

    def param_count(self, dim: int, *, active: bool = False) -> int:
        """Weights of one layer of width `dim`: the router, the routed experts (with `active`
        only the top_k a token goes through) and the shared experts."""
        experts = self.top_k if active else self.num_experts
        shared = 3 * dim * self.hidden_dim * self.num_shared_experts
        per_expert = 3 * dim * self.hidden_dim
        if self.expert_biases:
            per_expert += 2 * self.hidden_dim + dim
        router = dim * self.num_experts + (self.num_experts if self.router_bias else 0)
        return router + per_expert * experts + shared

    def problems(self, dim: int) -> list[str]:
        """What is inconsistent in these arguments for a model of width `dim`."""
        out = []
        if not 1 <= self.top_k <= self.num_experts:
            out.append(f"top_k = {self.top_k} must be 1 .. num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups:
            out.append(
                f"num_experts = {self.num_experts} is not divisible by num_groups = {self.num_groups}"
            )
        elif not 1 <= self.top_k_groups <= self.num_groups:
            out.append(f"top_k_groups = {self.top_k_groups} must be 1 .. num_groups")
        elif self.top_k > self.top_k_groups * (self.num_experts // self.num_groups):
            out.append(
                f"top_k = {self.top_k} is more than the experts of top_k_groups = {self.top_k_groups} groups"
            )
        if self.aux_loss_type not in ("sequence", "batch"):
            out.append(f"aux_loss_type = {self.aux_loss_type!r}: use sequence or batch")
        if self.router_selection not in ("topk", "sinkhorn"):
            out.append(f"router_selection = {self.router_selection!r}: use topk or sinkhorn")
        elif self.router_selection == "sinkhorn" and self.load_balance_coeff is not None:
            out.append(
                "router_selection = 'sinkhorn' balances each step itself: it goes with"
                " load_balance_coeff = None (no expert bias)"
            )
        if self.capacity_factor is not None and self.capacity_factor < 1:
            out.append(
                f"capacity_factor = {self.capacity_factor} must be 1 or more (None: no limit):"
                " the experts must have room for every token's choices"
            )
        if self.sinkhorn_iters < 1:
            out.append(f"sinkhorn_iters = {self.sinkhorn_iters} must be 1 or more")
        if self.aux_loss_alpha < 0:
            out.append(f"aux_loss_alpha = {self.aux_loss_alpha} must be 0 (none) or more")
        if self.activation not in ("swiglu", "clamped_swiglu"):
            out.append(f"activation = {self.activation!r}: use swiglu or clamped_swiglu")
        if self.score_func not in ("softmax", "sigmoid"):
            out.append(f"score_func = {self.score_func!r}: use softmax or sigmoid")
        if dim <= 0 or self.hidden_dim <= 0:
            out.append("dim and hidden_dim must be positive")
        return out


HF_BALANCING = dict(load_balance_coeff=None, aux_loss_alpha=1e-3, aux_loss_type="batch")
"""Balancing for Qwen3-MoE and Llama 4: the batch-level auxiliary loss at their Hugging Face
configs' `router_aux_loss_coef` (0.001) and no expert bias, which their checkpoints cannot hold
(so a trained model exports). Qwen3-MoE's reference trains so; Llama 4's do not: Hugging Face's
Llama 4 computes no balance loss, torchtitan's balances with the expert bias (0.001)."""

DEBUG_CAPACITY = 1.25
"""The MoE debug flavors' `capacity_factor`, on top of their reference's balancing (not a
reference's scheme). At the debug configs' lr 3e-3 the router's inputs grow nearly parallel
within a few steps, and every balancer that reacts to the previous steps' loads (auxiliary
loss of any weight, expert bias of any step) leaves layers at 2-8 times their share, and
Sinkhorn selection (balancing the current tokens softly) at 2-2.4; the capacity holds every
layer at 1.25 (trainer README, "Mixture of experts"). Inference routes as the reference."""

DEBUG_BALANCING = dict(capacity_factor=DEBUG_CAPACITY, router_centering=True)
"""What the MoE debug flavors add to their reference's balancing (MoEArgs changes): the
capacity above, and `router_centering`. At lr 3e-3 the router's inputs grow nearly parallel
within 10 steps (in the deepest layers 90-96% of their mean square along the mean token), so
the router's own top-k sends every token to one pair of experts and the capacity re-routes
67-84% of that layer's choices from step 20; with the mean of the last step's inputs
subtracted, the router's own top-k is left the tokens' differences and the capacity
re-routes 7-20% (Qwen3), 8-18% (DeepSeek-V3), 18-36% (Llama 4's top-1) (trainer README,
"Mixture of experts")."""

A = TypeVar("A")


def with_moe(args: A, **changes) -> A:
    """A family's `args` with fields of its MoEArgs changed (e.g. use_grouped_mm=False)."""
    return dataclasses.replace(args, moe=dataclasses.replace(args.moe, **changes))
