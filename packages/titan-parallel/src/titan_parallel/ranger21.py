"""Ranger21 (Wright & Demeure 2021, "Ranger21: a synergistic deep learning optimizer",
arXiv:2106.13731), exact under FSDP2, HSDP, DDP, tensor and pipeline parallel.

One step, for the parameters of every group together (t counts steps from 1):

1. Adaptive gradient clipping, unit-wise (Brock et al. 2021, arXiv:2102.06171): a unit is a
   row (a slice along dim 0) of a matrix, or a whole vector. A unit whose gradient norm exceeds
   `agc_clip` x max(its parameter norm, `agc_eps`) is scaled down to that norm.
2. Gradient centralization (Yong et al. 2020, arXiv:2004.01461): each row of a matrix's
   gradient loses its mean.
3. The core's second moment: AdamW's v = b2 v + (1 - b2) g^2, or MADGRAD's (Defazio & Jelassi
   2021, arXiv:2101.11075) dual averages, s += lambda g and S += lambda g^2 with
   lambda = lr_t sqrt(t).
4. Stable weight decay (Xie et al. 2020, arXiv:2011.11152): p *= 1 - lr_t wd / v_bar, v_bar
   the square root of the mean of v / (1 - b2^t) over every element of the model (the cube
   root of the mean of S under MADGRAD, whose step is lambda); off: AdamW's decoupled decay
   p *= 1 - lr_t wd.
5. Norm loss (Georgiou et al. 2021, arXiv:2103.06583): the gradient of
   `norm_loss_factor` x sum over units (1 - ||p_unit||)^2, applied as
   p_unit *= 1 - lr_t 2 factor (1 - 1 / (||p_unit|| + eps)) on the decayed weights.
6. The core step. AdamW with positive-negative momentum (Xie et al. 2021, arXiv:2103.17182):
   two first moments m+, m- that take turns, the current one m = b1^2 m + (1 - b1^2) g, the
   update ((1 + b0) m - b0 m_other) / sqrt((1 + b0)^2 + b0^2); without it Adam's
   m = b1 m + (1 - b1) g. p -= lr_t / (1 - b1^t) x update / denom, denom =
   sqrt(v / (1 - b2^t)) + eps. MADGRAD: p = (1 - c) p + c (x0 - s / (S^(1/3) + eps)),
   c = 1 - b1.
7. Softplus denominator (Tong et al. 2019, arXiv:1908.00700): denom = softplus(denom, beta).
8. Lookahead (Zhang et al. 2019, arXiv:1907.08610): every `lookahead_steps` steps
   p = alpha p + (1 - alpha) slow, then slow = p.

lr_t is the group's `lr` times the linear warm-up of Ma & Yarats (2019, arXiv:1910.04209):
t / W over the first W = 2 / (1 - b2) steps (22% of the run when that is more than 45% of
it), then the explore-exploit schedule's warm-down: flat until `warmdown_start_pct` of
`total_steps`, then linear to `warmdown_min_lr` at the last step.

Differences from the reference implementation (lessw2020/Ranger21), each on purpose: weight
decay and norm loss apply to every parameter (the reference applies them to the last one of
each group only); the positive-negative momentum uses `pnm_beta0` in both its coefficients and
its noise normalisation (the reference fixes the first to 1 and normalises with b2); there is
no AMSGrad maximum (the reference's never takes effect); a 3-D tensor's unit is a slice along
dim 0 (the reference takes dim 1 only); MADGRAD's stable decay uses MADGRAD's own S.

Exactness under sharding: the per-unit norms, the row means and the global mean are sums
over elements that a DTensor may spread over ranks. Each is reduced over exactly the mesh
dimensions that shard what it sums (`titan_parallel.sharded_stats`), and the global mean
also over `pipeline_group` (pipeline stages hold different parameters). So every layout takes
the step one process takes on the full tensors, up to the order of floating-point sums.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from titan_core.protocols import OptimizerPlugin, moment_size
from titan_parallel import ranger21_kernels as kernels
from titan_parallel.sharded_stats import local, reduce_sums, row_sums_groups, total_sums_groups

Core = Literal["adamw", "madgrad"]


COMPONENTS = (
    "agc",
    "gradient_centralization",
    "pnm",
    "norm_loss",
    "stable_weight_decay",
    "warmup",
    "warmdown",
    "lookahead",
    "softplus",
)
"""The switches of Ranger21's components (keyword arguments of `Ranger21`): all False is AdamW."""


class Ranger21(Optimizer):
    """Ranger21 with every component switchable (see the module docstring for the formulas).

    Args:
        params: parameters or parameter groups (groups may set lr, betas, eps, weight_decay).
        lr: peak learning rate.
        betas: (b1, b2): first-moment decay (MADGRAD: its momentum) and second-moment decay.
        weight_decay: the decay coefficient (stable, or decoupled when `stable_weight_decay`
            is off).
        total_steps: optimizer steps of the whole run; needed by the warm-down and the
            automatic warm-up length.
        warmup_steps: None picks Ma & Yarats' 2 / (1 - b2).
        state_dtype: dtype the moments are stored in (float32 or bfloat16); they are updated
            in float32 and stored with stochastic rounding, so that an average with b2 near
            1 still moves. Lookahead's slow weights and MADGRAD's x0 keep the parameters' dtype.
        pipeline_group: ranks holding other pipeline stages of the same model, over which the
            stable-weight-decay mean is taken too; None for a model that is not pipelined.
        compiled: take the step as three torch.compile'd kernels per parameter
            (`titan_parallel.ranger21_kernels`) instead of foreach passes: the same formulas
            with fewer passes over memory, at the cost of compiling once per process (tens of
            seconds on a CPU, cached by inductor across runs). Under fake tensors (the
            trainer's dry run) the eager step runs instead.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-4,
        *,
        core: Core = "adamw",
        agc: bool = True,
        agc_clip: float = 1e-2,
        agc_eps: float = 1e-3,
        gradient_centralization: bool = True,
        pnm: bool = True,
        pnm_beta0: float = 1.0,
        norm_loss: bool = True,
        norm_loss_factor: float = 1e-4,
        stable_weight_decay: bool = True,
        warmup: bool = True,
        warmup_steps: int | None = None,
        warmdown: bool = True,
        warmdown_start_pct: float = 0.72,
        warmdown_min_lr: float = 3e-5,
        total_steps: int | None = None,
        lookahead: bool = True,
        lookahead_steps: int = 5,
        lookahead_alpha: float = 0.5,
        softplus: bool = True,
        softplus_beta: float = 50.0,
        state_dtype: torch.dtype = torch.float32,
        pipeline_group: dist.ProcessGroup | None = None,
        compiled: bool = False,
    ) -> None:
        problems = []
        if lr < 0:
            problems.append(f"lr = {lr}: use a learning rate of 0 or more")
        if not all(0 <= b < 1 for b in betas):
            problems.append(f"betas = {betas}: use values in [0, 1)")
        if core not in ("adamw", "madgrad"):
            problems.append(f"core = {core!r}: use 'adamw' or 'madgrad'")
        if state_dtype not in (torch.float32, torch.bfloat16):
            problems.append(f"state_dtype = {state_dtype}: use torch.float32 or torch.bfloat16")
        if lookahead and lookahead_steps < 1:
            problems.append(f"lookahead_steps = {lookahead_steps}: use 1 or more")
        if not 0 <= lookahead_alpha <= 1:
            problems.append(f"lookahead_alpha = {lookahead_alpha}: use a value in [0, 1]")
        if not 0 <= warmdown_start_pct <= 1:
            problems.append(f"warmdown_start_pct = {warmdown_start_pct}: use a value in [0, 1]")
        if total_steps is None and (warmdown or (warmup and warmup_steps is None)):
            problems.append(
                "total_steps is not set: the warm-down and the automatic warm-up length need "
                "the run's length; pass total_steps, or warmup_steps and warmdown=False"
            )
        if warmup_steps is not None and warmup_steps < 0:
            problems.append(f"warmup_steps = {warmup_steps}: use 0 or more")
        if problems:
            raise ValueError("Ranger21: " + "; ".join(problems))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.core = core
        self.agc, self.agc_clip, self.agc_eps = agc, agc_clip, agc_eps
        self.gradient_centralization = gradient_centralization
        self.pnm, self.pnm_beta0 = pnm, pnm_beta0
        self.norm_loss, self.norm_loss_factor = norm_loss, norm_loss_factor
        self.stable_weight_decay = stable_weight_decay
        self.warmup, self.warmdown = warmup, warmdown
        self.warmdown_start_pct, self.warmdown_min_lr = warmdown_start_pct, warmdown_min_lr
        self.total_steps = total_steps
        self.warmup_steps = (
            warmup_steps if warmup_steps is not None else self.auto_warmup(betas[1], total_steps)
        )
        self.lookahead, self.lookahead_steps = lookahead, lookahead_steps
        self.lookahead_alpha = lookahead_alpha
        self.softplus, self.softplus_beta = softplus, softplus_beta
        self.state_dtype = state_dtype
        self.pipeline_group = pipeline_group
        self.compiled = compiled
        # The trainer leaves the learning rate to an optimizer that schedules it itself.
        self.owns_lr_schedule = warmup or warmdown
        self._t: int | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._t = None  # read from the loaded state at the next step

    # ------------------------------------------------------------------ schedule

    @staticmethod
    def auto_warmup(beta2: float, total_steps: int | None) -> int:
        """Ma & Yarats' untuned linear warm-up, 2 / (1 - b2) steps; 22% of the run when that
        is more than 45% of it (the reference's rule for short runs)."""
        steps = math.ceil(2.0 / (1.0 - beta2))
        if total_steps and steps > 0.45 * total_steps:
            steps = int(0.22 * total_steps)
        return steps

    def lr_at(self, lr: float, t: int) -> float:
        """The learning rate of step t (from 1) for a group whose peak is `lr`."""
        out = lr
        if self.warmup and self.warmup_steps > 0 and t <= self.warmup_steps:
            out = lr * t / self.warmup_steps
        if self.warmdown:
            start = int(self.warmdown_start_pct * self.total_steps)
            if t > start and self.total_steps > start:
                frac = min(1.0, (t - start) / (self.total_steps - start))
                floor = min(self.warmdown_min_lr, lr)
                out = min(out, lr - (lr - floor) * frac)
        return out

    # ------------------------------------------------------------------ state

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32)
        moments = (
            ("exp_avg", "exp_avg_sq") + (("exp_avg_neg",) if self.pnm else ())
            if self.core == "adamw"
            else ("grad_sum", "grad_sum_sq")
        )
        for name in moments:
            state[name] = torch.zeros_like(p, dtype=self.state_dtype)
        if self.core == "madgrad":
            state["x0"] = p.detach().clone()
        if self.lookahead:
            state["slow"] = p.detach().clone()

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, resumed = [], None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Ranger21 does not support sparse gradients")
                if isinstance(p, DTensor) and p.grad.placements != p.placements:
                    # A gradient may come back in another layout (e.g. Partial or Replicate
                    # under TP); the step works shard by shard, on the parameter's layout.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                if not self.state[p]:
                    self._init_state(p, self.state[p])
                elif resumed is None:
                    resumed = self.state[p]["step"]
            if params:
                groups.append((group, params))
        if not groups:
            return loss
        # The step count lives in the state (per parameter, for checkpoints) and, as a Python
        # int, here: reading it back from a tensor every step would not work on fake tensors.
        if self._t is None:
            self._t = 0 if resumed is None else int(resumed.item())
        self._t += 1
        t = self._t
        torch._foreach_add_([self.state[p]["step"] for _, ps in groups for p in ps], 1.0)

        all_params = [p for _, ps in groups for p in ps]
        fused = self.compiled and not is_fake(local(all_params[0]))
        units = None
        if self.agc or self.gradient_centralization or self.norm_loss:
            units = self._unit_factors(all_params, fused)

        per_group = []
        for group, params in groups:
            lr = self.lr_at(group["lr"], t)
            group["scheduled_lr"] = lr
            grads = [local(p.grad) for p in params]
            names = ("grad_sum", "grad_sum_sq") if self.core == "madgrad" else ("exp_avg_sq",)
            second = self._moments(params, names[-1])
            first = self._moments(params, "grad_sum") if self.core == "madgrad" else None
            if fused:
                sums = self._fused_second_moment(group, params, grads, lr, t, first, second, units)
            else:
                sums = None
                self._eager_second_moment(group, grads, lr, t, first, second)
            per_group.append((group, params, grads, lr, second, sums))

        v_bar = self._stable_decay_statistic(per_group, t) if self.stable_weight_decay else None

        for group, params, grads, lr, second, _ in per_group:
            factors = self._decay_factors(group, params, lr, t, v_bar, units)
            if fused:
                self._fused_update(group, params, grads, lr, t, second, factors)
            else:
                self._apply_factors(params, factors)
                if self.core == "madgrad":
                    self._madgrad_step(group, params, lr, t, second)
                else:
                    self._adamw_step(group, params, grads, lr, t, second)
            self._store_moments(params)

        if self.lookahead and t % self.lookahead_steps == 0:
            ps = [local(p) for p in all_params]
            slow = [local(self.state[p]["slow"]) for p in all_params]
            torch._foreach_lerp_(ps, slow, 1.0 - self.lookahead_alpha)
            torch._foreach_copy_(slow, ps)
        return loss

    def _moments(self, params: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        """Float32 working copies of a moment (the stored tensors themselves when they are
        float32); `_store_moments` writes bfloat16 ones back."""
        out = []
        for p in params:
            stored = local(self.state[p][name])
            work = stored if stored.dtype == torch.float32 else stored.float()
            self._working.setdefault(id(p), {})[name] = (stored, work)
            out.append(work)
        return out

    @property
    def _working(self) -> dict:
        if not hasattr(self, "_working_copies"):
            self._working_copies: dict = {}
        return self._working_copies

    def _store_moments(self, params: list[torch.Tensor]) -> None:
        for p in params:
            for stored, work in self._working.pop(id(p), {}).values():
                if work is not stored:
                    stored.copy_(stochastic_round_to_bf16(work))

    def _unit_factors(self, params: list[torch.Tensor], fused: bool) -> dict[int, tuple]:
        """Per unit (row) of each parameter, reduced over the ranks that hold parts of the same
        units: (weight norm, clipping scale or None, centralization shift or None), shaped to
        broadcast against the parameter. The eager step applies the clipping and the
        centralization to the gradients here, in place; the fused one in its second kernel."""
        stats, groups = [], []
        for p in params:
            w, g = local(p), local(p.grad)
            if fused:
                stats.append(kernels.compiled("unit_stats")(w, g))
            else:
                dims = tuple(range(1, w.ndim)) if w.ndim > 1 else None
                rows = [_sq_norm(w, dims), _sq_norm(g, dims)]
                rows.append(g.sum(dims) if dims else g.sum().reshape(1))
                stats.append(torch.stack([r.float() for r in rows]))
            groups.append(row_sums_groups(p))
        reduce_sums(stats, groups)
        out = {}
        for p, s in zip(params, stats):
            g = local(p.grad)
            shape = (-1,) + (1,) * (g.ndim - 1) if g.ndim > 1 else ()
            p_norm, g_norm, g_sum = s[0].sqrt(), s[1].sqrt(), s[2]
            scale = shift = None
            if self.agc:
                limit = p_norm.clamp(min=self.agc_eps) * self.agc_clip
                scale = torch.where(g_norm > limit, limit / g_norm.clamp(min=1e-6), 1.0)
                scale = scale.reshape(shape)
                if not fused:
                    g.mul_(scale.to(g.dtype))
            if self.gradient_centralization and g.ndim > 1:
                shift = g_sum / (p.numel() // p.shape[0])  # global columns per row
                if scale is not None:
                    shift = shift.reshape(shape) * scale
                shift = shift.reshape(shape)
                if not fused:
                    g.sub_(shift.to(g.dtype))
            out[id(p)] = (p_norm.reshape(shape), scale, shift)
        return out

    def _eager_second_moment(self, group, grads, lr, t, first, second) -> None:
        if self.core == "madgrad":
            lamb = lr * math.sqrt(t)
            torch._foreach_add_(first, grads, alpha=lamb)
            torch._foreach_addcmul_(second, grads, grads, value=lamb)
        else:
            b2 = group["betas"][1]
            torch._foreach_mul_(second, b2)
            torch._foreach_addcmul_(second, grads, grads, value=1 - b2)

    def _fused_second_moment(self, group, params, grads, lr, t, first, second, units):
        """The second kernel for each parameter; returns the sums of its second moment."""
        sums = []
        dev = grads[0].device
        if self.core == "madgrad":
            lamb = torch.tensor(lr * math.sqrt(t), device=dev)
            kernel = kernels.compiled("second_moment_madgrad")
        else:
            b2 = torch.tensor(group["betas"][1], device=dev)
            kernel = kernels.compiled("second_moment_adamw")
        for i, (p, g) in enumerate(zip(params, grads)):
            _, scale, shift = units[id(p)] if units is not None else (None, None, None)
            if self.core == "madgrad":
                sums.append(kernel(g, first[i], second[i], scale, shift, lamb).sum())
            else:
                sums.append(kernel(g, second[i], scale, shift, b2).sum())
        return sums

    def _fused_update(self, group, params, grads, lr, t, second, factors) -> None:
        """The third kernel for each parameter: decay and norm loss, then the core's step."""
        dev = grads[0].device
        T = lambda x: torch.tensor(x, dtype=torch.float32, device=dev)  # noqa: E731
        beta = self.softplus_beta if self.softplus else None
        eps = T(group["eps"])
        if self.core == "madgrad":
            c = T(1 - group["betas"][0])
            grad_sum = [self._working[id(p)]["grad_sum"][1] for p in params]
            kernel = kernels.compiled("madgrad_update")
            for p, s, big_s, f in zip(params, grad_sum, second, factors):
                x0 = local(self.state[p]["x0"])
                kernel(local(p), s, big_s, x0, f, eps, c, beta)
            return
        b1, b2 = group["betas"]
        if self.pnm:
            b0 = self.pnm_beta0
            pos = self._moments(params, "exp_avg")
            neg = self._moments(params, "exp_avg_neg")
            current, other = (pos, neg) if t % 2 == 1 else (neg, pos)
            noise = math.sqrt((1 + b0) ** 2 + b0**2)
            b1_t, c_cur, c_other = T(b1 * b1), T((1 + b0) / noise), T(b0 / noise)
        else:
            current, other = self._moments(params, "exp_avg"), [None] * len(params)
            b1_t, c_cur, c_other = T(b1), T(1.0), T(0.0)
        bias2, step_size = T(math.sqrt(1 - b2**t)), T(lr / (1 - b1**t))
        kernel = kernels.compiled("adamw_update")
        for p, g, m, mo, v, f in zip(params, grads, current, other, second, factors):
            kernel(local(p), g, m, mo, v, f, b1_t, c_cur, c_other, bias2, eps, step_size, beta)

    def _stable_decay_statistic(self, per_group: list, t: int) -> torch.Tensor:
        """v_bar: the root (square for AdamW, cube for MADGRAD) of the mean second moment
        over every element of the model, on every rank."""
        partials, groups, count = [], [], 0
        for group, params, _, _, second, sums in per_group:
            if sums is None:  # moments are >= 0: the L1 norm is the sum
                sums = torch._foreach_norm(second, 1)
            scale = 1.0 if self.core == "madgrad" else 1.0 / (1 - group["betas"][1] ** t)
            for p, s in zip(params, sums):
                partials.append((s.float() * scale).reshape(1))
                groups.append(total_sums_groups(p))
                count += p.numel()
        reduce_sums(partials, groups)
        total = torch.cat([torch.cat(partials).sum().reshape(1), partials[0].new_tensor([count])])
        if self.pipeline_group is not None and dist.get_world_size(self.pipeline_group) > 1:
            dist.all_reduce(total, group=self.pipeline_group)
        mean = total[0] / total[1]
        return mean.pow(1 / 3) if self.core == "madgrad" else mean.sqrt()

    def _decay_factors(self, group, params, lr, t, v_bar, units) -> list:
        """What each parameter is multiplied by before the core's step: the weight decay
        (stable or decoupled) and the norm loss, per unit; None where nothing changes."""
        wd = group["weight_decay"]
        if v_bar is not None and wd:
            step = lr * math.sqrt(t) if self.core == "madgrad" else lr
            # A model whose gradients are all zero has v_bar 0: no decay then.
            decay = torch.where(v_bar > 0, 1 - step * wd / v_bar.clamp(min=1e-30), 1.0)
        else:
            decay = torch.tensor(1.0 - lr * wd, device=local(params[0]).device)
        if not self.norm_loss:
            return [decay if wd else None] * len(params)
        out = []
        for p in params:
            norm = units[id(p)][0] * decay  # the norm after the decay: it scales every unit
            correction = 2 * self.norm_loss_factor * (1 - 1 / (norm + group["eps"]))
            out.append(decay * (1 - lr * correction))
        return out

    def _apply_factors(self, params, factors) -> None:
        ps = [local(p) for p in params]
        if all(f is None for f in factors):
            return
        if factors[0].dim() == 0 and all(f is factors[0] for f in factors):
            # One scalar for all (no norm loss): one foreach pass.
            torch._foreach_mul_(ps, factors[0])
            return
        for w, f in zip(ps, factors):
            if f is not None:
                w.mul_(f.to(w.dtype))

    def _adamw_step(self, group, params, grads, lr, t, second) -> None:
        b1, b2 = group["betas"]
        ps = [local(p) for p in params]
        if self.pnm:
            b0 = self.pnm_beta0
            pos, neg = (
                self._moments(params, "exp_avg"),
                self._moments(params, "exp_avg_neg"),
            )
            current, other = (pos, neg) if t % 2 == 1 else (neg, pos)
            torch._foreach_mul_(current, b1 * b1)
            torch._foreach_add_(current, grads, alpha=1 - b1 * b1)
            noise = math.sqrt((1 + b0) ** 2 + b0**2)
            update = torch._foreach_mul(current, (1 + b0) / noise)
            torch._foreach_add_(update, other, alpha=-b0 / noise)
        else:
            update = self._moments(params, "exp_avg")
            torch._foreach_lerp_(update, grads, 1 - b1)
        denom = torch._foreach_sqrt(second)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, group["eps"])
        if self.softplus:
            denom = [F.softplus(d, beta=self.softplus_beta) for d in denom]
        torch._foreach_addcdiv_(ps, update, denom, value=-lr / (1 - b1**t))

    def _madgrad_step(self, group, params, lr, t, second) -> None:
        ps = [local(p) for p in params]
        grad_sum = [self._working[id(p)]["grad_sum"][1] for p in params]
        rms = torch._foreach_pow(second, 1 / 3)
        torch._foreach_add_(rms, group["eps"])
        if self.softplus:
            rms = [F.softplus(r, beta=self.softplus_beta) for r in rms]
        z = torch._foreach_addcdiv([local(self.state[p]["x0"]) for p in params], grad_sum, rms, -1)
        torch._foreach_lerp_(ps, z, 1 - group["betas"][0])


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor (no data: the trainer's dry run), which compiled kernels
    are not run on."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _sq_norm(x: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    if dims is None:
        return torch.linalg.vector_norm(x.float()).square().reshape(1)
    return torch.linalg.vector_norm(x, dim=dims, dtype=torch.float32).square()


def stochastic_round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16 up or down at random, with the probability that makes
    the expected value `x`: adding random low bits before truncating."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class AdamW(Ranger21):
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay) on Ranger21's engine with every
    Ranger21 component off. It takes the same steps as `torch.optim.AdamW`; what it adds is the
    choice of `state_dtype`: bfloat16 moments (stochastically rounded) halve the optimizer's
    memory."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            **dict.fromkeys(COMPONENTS, False),
            state_dtype=state_dtype,
        )


class Ranger21Factory(OptimizerPlugin):
    """The `titan.optimizers` entry point `Ranger21` (`build_ranger21`)."""

    def __call__(
        self, params: list[torch.Tensor], config: Any, *, total_steps: int, dims: Any = None
    ) -> Ranger21:
        """A Ranger21 from an [optimizer] section (lr, beta1, beta2, eps, state_dtype, and the
        [optimizer.ranger21] switches, a `Ranger21Options`) for a run of `total_steps` steps
        laid out as `dims` (its pipeline mesh carries the stable-weight-decay mean across
        stages)."""
        return _build_ranger21(params, config, total_steps=total_steps, dims=dims)

    def state_copies(self, config: Any) -> float:
        """Ranger21's moments (three with positive-negative momentum, in `state_dtype`), or
        MADGRAD's two sums (in `state_dtype`) and its x0 (float32), and Lookahead's slow
        weights (float32)."""
        r = config.ranger21
        moment = moment_size(config)
        copies = 2 * moment + 1 if r.core == "madgrad" else (3 if r.pnm else 2) * moment
        return copies + (1 if r.lookahead else 0)


def _build_ranger21(
    params: list[torch.Tensor], config: Any, *, total_steps: int, dims: Any = None
) -> Ranger21:
    options = dataclasses.asdict(config.ranger21)  # every switch, under its keyword's name
    options["compiled"] = options.pop("compiled_step")
    if options["warmup_steps"] == -1:
        options["warmup_steps"] = None  # automatic length
    pp_mesh = dims.mesh("pp") if dims is not None else None
    return Ranger21(
        params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        **options,
        total_steps=total_steps,
        state_dtype=getattr(torch, config.state_dtype),
        pipeline_group=pp_mesh.get_group() if pp_mesh is not None else None,
    )


build_ranger21 = Ranger21Factory()
