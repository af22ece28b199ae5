"""Small, real things the tests train and checkpoint: a 2-block model with dropout (so that RNG
restore matters), a deterministic stateful data source, and layout builders using torch's own
fully_shard / parallelize_module."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w2(torch.nn.functional.gelu(self.w1(x))))


class ToyModel(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, dropout) for i in range(n_layers)})
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.out(self.norm(x))


class ToyData:
    """Batch i of data-parallel rank r is a pure function of (seed, r, i); the state is i."""

    def __init__(self, seed: int = 0, dp_rank: int = 0, batch: int = 4, seq: int = 8):
        self.seed, self.dp_rank, self.batch, self.seq = seed, dp_rank, batch, seq
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + self.dp_rank * 7919 + self.position
        )
        tokens = torch.randint(VOCAB, (self.batch, self.seq + 1), generator=g)
        self.position += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.seed = int(state["position"]), int(state["seed"])


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    data: ToyData
    state: TrainState

    def states(self) -> dict:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.scheduler,
            "dataloader": self.data,
            "train_state": self.state,
        }


def build_mesh(layout: str):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout in ("single",):
        return None
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    if layout == "fsdp_tp":
        return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    raise ValueError(layout)


def apply_layout(model: ToyModel, layout: str, mesh) -> int:
    """Parallelise `model` in place; returns this rank's data-parallel rank."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layout == "single":
        return 0
    if layout == "fsdp_tp":
        plan = {}
        for name in model.layers:
            plan[f"layers.{name}.w1"] = ColwiseParallel()
            plan[f"layers.{name}.w2"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
        shard_mesh = mesh["dp_shard"]
        dp_rank = shard_mesh.get_local_rank()
    else:
        shard_mesh = mesh
        dp_rank = dist.get_rank()
    for block in model.layers.values():
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return dp_rank


def build_run(
    layout: str = "single", seed: int = 0, data_seed: int = 7, mesh=None, dropout: float = 0.1
) -> Run:
    torch.manual_seed(seed)
    model = ToyModel(dropout=dropout)
    mesh = mesh if mesh is not None or layout == "single" else build_mesh(layout)
    dp_rank = apply_layout(model, layout, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return Run(model, optimizer, scheduler, ToyData(data_seed, dp_rank), TrainState())


def train(run: Run, steps: int, checkpointer=None, last_step: int | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        run.state.step += 1
        inputs, labels = run.data.next()
        logits = run.model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        run.state.tokens_seen += inputs.numel()
        losses.append(loss.item())
        if checkpointer is not None:
            checkpointer.save(run.state.step, last_step=run.state.step == last_step)
    return losses


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter and buffer, on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415

    return {k: full(v).detach().clone() for k, v in get_model_state_dict(model).items()}


def full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name, unsharded, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: PLC0415

    sd = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {
        k: full(v).detach().clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()
    }


def assert_same(a: dict, b: dict, what: str) -> None:
    """Bitwise equality of two flat dicts of tensors / plain values."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]!r} != {b[k]!r}"
