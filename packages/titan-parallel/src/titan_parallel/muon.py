"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks",
kellerjordan.github.io/posts/muon) with AdamW for the other parameters, exact under FSDP2,
HSDP, DDP, tensor, expert and pipeline parallel.

One step for a matrix W with gradient G (a parameter of two or more dimensions whose group
has `use_muon`; a 3-D expert weight is a stack of matrices, each orthogonalised alone):

1. Momentum: M = mu M + (1 - mu) G; the update is U = (1 - mu) G + mu M with Nesterov
   momentum (the default), else U = M.
2. Orthogonalisation: O = NS(U), five iterations of the quintic Newton-Schulz map
   X <- a X + (b X X^T + c (X X^T)^2) X, (a, b, c) = (3.4445, -4.7750, 2.0315), from
   X = U / ||U||_F (transposed when it has more rows than columns). It takes U = A S B^T to
   about A S' B^T with S' between roughly 0.7 and 1.2: the nearest semi-orthogonal matrix,
   loosely. Run in `ns_dtype` (bfloat16 as in the reference; float32 for exact comparisons).
3. Decoupled weight decay and the step: W <- (1 - lr wd) W - lr s O, where s is
   `adjust_lr`'s scale for a matrix of A outputs and B inputs (nn.Linear's (A, B); a 3-D
   expert weight is (experts, B, A)): "original", sqrt(max(1, A / B)) (Jordan's), or
   "match_rms_adamw", 0.2 sqrt(max(A, B)) (Liu et al. 2025, "Muon is scalable for LLM
   training", arXiv:2502.16982: the update's RMS becomes ~0.2, AdamW's typical one, so that
   AdamW's learning rate and weight decay carry over).

Parameters whose group has `use_muon` False (embeddings, norms, biases, the output head, MoE
routers: see `muon_param_groups`) take AdamW's step (Loshchilov & Hutter 2019) with the
group's betas, eps and weight decay, the same formulas as `torch.optim.AdamW`.

Exactness under sharding: the momentum and AdamW are elementwise, so each rank updates its
shard alone. Newton-Schulz needs the whole matrix: for a DTensor parameter the update is
gathered over exactly the mesh dimensions that split its last two dimensions (a 3-D expert
weight split over experts by expert parallel needs no gathering; its experts are whole),
orthogonalised, and each rank keeps its own shard (`gather`: Moonlight's "distributed Muon").
That costs an all-gather of each matrix over its sharding group and one full matrix at a time
in memory on every rank, and every rank of the group runs the same Newton-Schulz on it (its
compute is about 5 x 2 x min(A, B) x A x B x 3 FLOPs per matrix, under 1% of a training
step's for a large model). `owner` splits that work: the matrices of a sharding group are
dealt round-robin to its ranks; each rank receives the shards of the matrices it owns (an
all-to-all), orthogonalises them, and sends the shards back, so communication and compute
per rank fall by the group size and each rank holds only its own matrices whole. It applies
to parameters whose matrix dimensions one mesh dimension splits with a plain `Shard` (FSDP,
HSDP, TP alone); the others (FSDP x TP) use `gather`. Plain tensors (one process, DDP, a
pipeline stage's own parameters) are orthogonalised where they are. So every layout takes the
step one process takes, up to the order of floating-point sums in the gradients.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim import Optimizer

from titan_core.device import supports_bf16
from titan_core.protocols import OptimizerPlugin
from titan_parallel.sharded_stats import local

logger = logging.getLogger(__name__)

AdjustLR = Literal["original", "match_rms_adamw"]
Distributed = Literal["gather", "owner"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Jordan's quintic Newton-Schulz coefficients (a, b, c): the largest slope at zero for which
five iterations still bring every singular value of a unit-norm matrix into about [0.7, 1.2]."""

ADAMW_NAMES = frozenset({"output", "lm_head", "head", "router", "gate", "wte", "wpe"})
"""Module names (a component of a parameter's name) whose matrices `muon_param_groups` gives to
AdamW: output heads and MoE routers (Muon is for hidden matrices); embeddings are found by type."""


def newton_schulz(
    update: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """The orthogonalised `update` (a matrix, or a stack of matrices along the leading
    dimensions, each taken alone), computed in `dtype` and returned in it."""
    a, b, c = coefficients
    shape = update.shape
    x = update.reshape(-1, shape[-2], shape[-1]).to(dtype, copy=True)
    tall = x.size(-2) > x.size(-1)
    if tall:  # X X^T is then the smaller Gram matrix
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(shape)


def lr_scale(shape: torch.Size, adjust_lr: AdjustLR) -> float:
    """The factor on the learning rate of a matrix: a 2-D weight is nn.Linear's (out, in), a
    3-D one a stack of experts (experts, in, out), the layout titan's MoE plans use."""
    rows, cols = (shape[-1], shape[-2]) if len(shape) == 3 else (shape[-2], shape[-1])
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def uses_muon(name: str, param: torch.Tensor, embedding: bool = False) -> bool:
    """Whether Muon orthogonalises a parameter by default: a matrix (or stack of matrices) that
    is not an embedding (`embedding`: it belongs to an nn.Embedding), an output head or a MoE
    router (a component of `name` in `ADAMW_NAMES`)."""
    parts = set(name.split("."))
    return param.ndim >= 2 and not embedding and not (parts & ADAMW_NAMES)


def muon_param_groups(model: nn.Module, **adamw_options: Any) -> list[dict[str, Any]]:
    """`model`'s trainable parameters in two groups for `Muon`: the hidden matrices
    (`uses_muon`) and the rest with `use_muon=False` (and `adamw_options`, e.g. lr)."""
    embedding = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (hidden if uses_muon(name, p, id(p) in embedding) else rest).append(p)
    groups = [{"params": hidden, "use_muon": True}] if hidden else []
    if rest:
        groups.append({"params": rest, "use_muon": False, **adamw_options})
    return groups


class Muon(Optimizer):
    """Muon for the matrices of groups with `use_muon` (default: parameters of 2 or more
    dimensions), AdamW for the rest (see the module docstring for the formulas).

    Args:
        params: parameters or parameter groups; a group may set lr, weight_decay, betas, eps,
            momentum, nesterov and use_muon (`muon_param_groups` builds the usual two).
        lr: learning rate (Muon's and AdamW's; `adjust_lr` scales Muon's per matrix).
        weight_decay: decoupled weight decay, p *= 1 - lr wd, for both kinds.
        momentum, nesterov: Muon's momentum.
        ns_steps, ns_coefficients, ns_dtype: the Newton-Schulz iteration.
        adjust_lr: "original" (Jordan's sqrt(max(1, A / B)); tune lr for Muon, ~0.02) or
            "match_rms_adamw" (Moonlight's 0.2 sqrt(max(A, B)); AdamW's lr and weight decay).
        betas, eps: AdamW's, for the parameters Muon does not orthogonalise.
        distributed: how a sharded matrix is orthogonalised: "gather" (every rank of its
            sharding group gathers it and runs Newton-Schulz) or "owner" (one rank per matrix,
            the shards sent to it and back); see the module docstring.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        *,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: torch.dtype = torch.bfloat16,
        adjust_lr: AdjustLR = "original",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        distributed: Distributed = "gather",
    ) -> None:
        problems = []
        if lr < 0:
            problems.append(f"lr = {lr}: use a learning rate of 0 or more")
        if not 0 <= momentum < 1:
            problems.append(f"momentum = {momentum}: use a value in [0, 1)")
        if not all(0 <= b < 1 for b in betas):
            problems.append(f"betas = {betas}: use values in [0, 1)")
        if ns_steps < 1:
            problems.append(f"ns_steps = {ns_steps}: use 1 or more")
        if adjust_lr not in ("original", "match_rms_adamw"):
            problems.append(f"adjust_lr = {adjust_lr!r}: use 'original' or 'match_rms_adamw'")
        if distributed not in ("gather", "owner"):
            problems.append(f"distributed = {distributed!r}: use 'gather' or 'owner'")
        if problems:
            raise ValueError("Muon: " + "; ".join(problems))
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            betas=betas,
            eps=eps,
            use_muon=None,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and p.ndim < 2:
                    raise ValueError(
                        f"Muon orthogonalises matrices, and a parameter of shape {tuple(p.shape)}"
                        " is in a group with use_muon=True; give it use_muon=False (AdamW)"
                    )
        self.ns_steps, self.ns_coefficients, self.ns_dtype = ns_steps, ns_coefficients, ns_dtype
        self.adjust_lr = adjust_lr
        self.distributed = distributed
        self.paths = {"local": 0, "gather": 0, "owner": 0}
        """How many matrices were orthogonalised where they are, gathered, or by an owner
        rank, over every step so far (see the module docstring)."""
        self._t: int | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._t = None  # read from the loaded state at the next step

    @staticmethod
    def is_muon(group: dict[str, Any], p: torch.Tensor) -> bool:
        """Whether `p` (in `group`) takes Muon's step."""
        return p.ndim >= 2 if group["use_muon"] is None else bool(group["use_muon"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon, adamw, resumed = [], [], None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                if isinstance(p, DTensor) and p.grad.placements != p.placements:
                    # Under TP a gradient may come back Partial or Replicate; the step works
                    # on the parameter's own shards.
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                muon_param = self.is_muon(group, p)
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    names = ("momentum_buffer",) if muon_param else ("exp_avg", "exp_avg_sq")
                    for name in names:
                        state[name] = torch.zeros_like(p)
                elif resumed is None:
                    resumed = state["step"]
                (muon if muon_param else adamw).append((group, p))
        if not muon and not adamw:
            return loss
        # The step count lives in the state (for checkpoints) and, as a Python int, here:
        # reading it back from a tensor every step would not work on fake tensors (dry run).
        if self._t is None:
            self._t = 0 if resumed is None else int(resumed.item())
        self._t += 1
        torch._foreach_add_([self.state[p]["step"] for _, p in muon + adamw], 1.0)
        if adamw:
            self._adamw_step(adamw, self._t)
        if muon:
            self._muon_step(muon)
        return loss

    # ------------------------------------------------------------------ AdamW

    def _adamw_step(self, pairs: list[tuple[dict, torch.Tensor]], t: int) -> None:
        by_group: dict[int, tuple[dict, list[torch.Tensor]]] = {}
        for group, p in pairs:
            by_group.setdefault(id(group), (group, []))[1].append(p)
        for group, params in by_group.values():
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            ps = [local(p) for p in params]
            grads = [local(p.grad) for p in params]
            m = [local(self.state[p]["exp_avg"]) for p in params]
            v = [local(self.state[p]["exp_avg_sq"]) for p in params]
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            if wd:
                torch._foreach_mul_(ps, 1 - lr * wd)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(1 - b2**t))
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(ps, m, denom, value=-lr / (1 - b1**t))

    # ------------------------------------------------------------------ Muon

    def _muon_step(self, pairs: list[tuple[dict, torch.Tensor]]) -> None:
        updates = []
        for group, p in pairs:
            g = local(p.grad)
            buf = local(self.state[p]["momentum_buffer"])
            mu = group["momentum"]
            buf.lerp_(g, 1 - mu)
            updates.append(g.lerp(buf, mu) if group["nesterov"] else buf)
        ortho = self._orthogonalise([p for _, p in pairs], updates)
        for (group, p), o in zip(pairs, ortho):
            w, lr, wd = local(p), group["lr"], group["weight_decay"]
            if wd:
                w.mul_(1 - lr * wd)
            w.add_(o.to(w.dtype), alpha=-lr * lr_scale(p.shape, self.adjust_lr))

    def _orthogonalise(
        self, params: list[torch.Tensor], updates: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each parameter's local shard of the orthogonalised (whole) update."""
        out: list[torch.Tensor | None] = [None] * len(params)
        owned: dict[str, list[int]] = {}
        for i, (p, u) in enumerate(zip(params, updates)):
            split = matrix_split(p)
            if not split:  # whole matrices here: a plain tensor, or split along experts only
                out[i], path = self._ns(u), "local"
            elif self.distributed == "owner" and owner_split_dim(p) is not None:
                group = p.device_mesh.get_group(split[0])
                owned.setdefault(group.group_name, []).append(i)
                path = "owner"
            else:
                out[i], path = self._gathered_ns(p, u, split), "gather"
            self.paths[path] += 1
        for indices in owned.values():
            shards = self._owner_ns([params[i] for i in indices], [updates[i] for i in indices])
            for i, shard in zip(indices, shards):
                out[i] = shard
        return out  # type: ignore[return-value]

    def _ns(self, u: torch.Tensor) -> torch.Tensor:
        return newton_schulz(u, self.ns_steps, self.ns_coefficients, self.ns_dtype)

    def _gathered_ns(self, p: DTensor, u: torch.Tensor, split: list[int]) -> torch.Tensor:
        """Gather `u` over the mesh dimensions in `split`, orthogonalise, keep this shard."""
        mesh = p.device_mesh
        whole = [Replicate() if d in split else pl for d, pl in enumerate(p.placements)]
        sharded = DTensor.from_local(
            u, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        with _quiet_redistribute():
            full = sharded.redistribute(mesh, whole).to_local()
        ortho = DTensor.from_local(
            self._ns(full), mesh, whole, run_check=False, shape=p.shape, stride=p.stride()
        )
        return ortho.redistribute(mesh, p.placements).to_local()

    def _owner_ns(self, params: list[DTensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Orthogonalise matrices that one mesh dimension shards: dealt round-robin to the
        ranks of that dimension's group, which receive the shards of their matrices, run
        Newton-Schulz and send each rank its shard back (two all-to-alls per round)."""
        mesh_dim = matrix_split(params[0])[0]
        group = params[0].device_mesh.get_group(mesh_dim)
        n, me = dist.get_world_size(group), dist.get_rank(group)
        out: list[torch.Tensor] = []
        for start in range(0, len(params), n):
            batch = list(zip(params[start : start + n], updates[start : start + n]))
            out += _owner_round(batch, group, n, me, self._ns)
        return out


@contextlib.contextmanager
def _quiet_redistribute():
    """Gathering an FSDP x TP matrix (`_StridedShard`, `Shard`) takes two all-gathers, which
    DTensor reports as suboptimal at every call; nothing a user can change."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def matrix_split(p: torch.Tensor) -> list[int]:
    """The mesh dimensions that split one of the last two dimensions of `p` (its matrices)."""
    if not isinstance(p, DTensor):
        return []
    found = []
    for mesh_dim, placement in enumerate(p.placements):
        if placement.is_partial():
            raise ValueError(
                f"a parameter has a Partial placement on mesh dimension {mesh_dim}; Muon needs"
                " parameters that are sharded or replicated"
            )
        dim = getattr(placement, "dim", None)  # Shard and _StridedShard
        if dim is not None and p.device_mesh.size(mesh_dim) > 1 and dim % p.ndim >= p.ndim - 2:
            found.append(mesh_dim)
    return found


def owner_split_dim(p: DTensor) -> int | None:
    """The tensor dimension that splits `p`'s matrices when exactly one mesh dimension does so
    with a plain `Shard` (what `owner` handles), else None."""
    split = matrix_split(p)
    if len(split) != 1:
        return None
    placement = p.placements[split[0]]
    if type(placement) is not Shard:  # _StridedShard's pieces are not contiguous chunks
        return None
    return placement.dim % p.ndim


def _chunk_sizes(length: int, n: int) -> list[int]:
    """The sizes DTensor's `Shard` gives the n ranks along a dimension of `length` (torch.chunk's
    split, with empty chunks at the end)."""
    size = -(-length // n)
    return [max(0, min(size, length - r * size)) for r in range(n)]


def _owner_round(batch, group, n: int, me: int, ns: Callable) -> list[torch.Tensor]:
    """One round of `Muon._owner_ns`: matrix k of `batch` (at most n) belongs to rank k."""
    shapes = []  # per matrix: (split dim, the chunk sizes along it, every rank's shard shape)
    for p, u in batch:
        dim = p.placements[matrix_split(p)[0]].dim % p.ndim
        sizes = _chunk_sizes(p.shape[dim], n)
        # The other dimensions as this rank holds them: the ranks of the group hold the same
        # slice of any leading (expert) dimension another mesh dimension splits.
        shard = [(*u.shape[:dim], s, *u.shape[dim + 1 :]) for s in sizes]
        shapes.append((dim, sizes, shard))
    # Send: my shard of matrix k to rank k.
    sends = [u.reshape(-1) for _, u in batch] + [batch[0][1].new_empty(0)] * (n - len(batch))
    send_sizes = [t.numel() for t in sends]
    recv_sizes = [math.prod(shapes[me][2][r]) for r in range(n)] if me < len(batch) else [0] * n
    received = _all_to_all(torch.cat(sends), send_sizes, recv_sizes, group)
    results = [batch[0][1].new_empty(0)] * n
    if me < len(batch):
        dim, _, shard = shapes[me]
        pieces = [c.view(s) for c, s in zip(received.split(recv_sizes), shard)]
        whole = ns(torch.cat(pieces, dim=dim)).to(batch[me][1].dtype)
        results = [c.reshape(-1) for c in whole.split(shapes[me][1], dim=dim)]
    # Return: rank r's shard of my matrix to rank r; mine of matrix k from rank k.
    back_recv = [math.prod(shapes[k][2][me]) for k in range(len(batch))] + [0] * (n - len(batch))
    back = _all_to_all(torch.cat(results), [t.numel() for t in results], back_recv, group)
    return [c.view(shapes[k][2][me]) for k, c in enumerate(back.split(back_recv)[: len(batch)])]


def _all_to_all(flat: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = flat.new_empty(sum(recv))
    dist.all_to_all_single(out, flat.contiguous(), recv, send, group=group)
    return out


class MuonFactory(OptimizerPlugin):
    """The `titan.optimizers` entry point `Muon` (`build_muon`); its state is counted as
    Adam's (the non-matrix parameters' AdamW), the default."""

    def __call__(
        self, params: list[Any], config: Any, *, total_steps: int, dims: Any = None
    ) -> Muon:
        return _build_muon(params, config, total_steps=total_steps, dims=dims)


def _build_muon(params: list[Any], config: Any, *, total_steps: int, dims: Any = None) -> Muon:
    """The `titan.optimizers` entry point `Muon`: a Muon from an [optimizer] section (lr,
    weight_decay, beta1, beta2, eps for AdamW, and the [optimizer.muon] options, a
    `MuonOptions`). `params` are parameter groups whose `use_muon` says which parameters Muon
    orthogonalises (the trainer sets it; a plain list takes Muon for every matrix), and the
    matrices' learning rate is [optimizer.muon] lr when set."""
    m = config.muon
    groups = list(params) if params and isinstance(params[0], dict) else [{"params": params}]
    if m.lr is not None:
        groups = [{**g, "lr": m.lr} if g.get("use_muon") and "lr" not in g else g for g in groups]
    return Muon(
        groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        ns_dtype=newton_schulz_dtype(m.ns_dtype, groups),
        adjust_lr=m.adjust_lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        distributed=m.distributed,
    )


def newton_schulz_dtype(choice: str, groups: list[dict]) -> torch.dtype:
    """[optimizer.muon] ns_dtype as a dtype; `auto` by the device of the parameters: bfloat16
    where it computes bf16 natively, and on the meta device (a dry run plans for a GPU)."""
    if choice != "auto":
        return getattr(torch, choice)
    device = next((p.device for g in groups for p in g["params"]), torch.device("meta"))
    native = device.type == "meta" or supports_bf16(device)
    if not native:
        logger.info("Muon: Newton-Schulz in float32 (%s has no native bf16 matmul)", device)
    return torch.bfloat16 if native else torch.float32


build_muon = MuonFactory()
