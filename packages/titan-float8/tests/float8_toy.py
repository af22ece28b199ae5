"""Small real models for the Float8 tests: a Llama-shaped block list for conversion counts
(built on the meta device, so 8B shapes cost nothing) and a tiny next-token model to train."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


class Block(nn.Module):
    """Attention and feed-forward projections with Llama's names (no attention maths)."""

    def __init__(self, dim: int, kv_dim: int, hidden: int):
        super().__init__()
        self.attention = nn.ModuleDict(
            {
                "wq": nn.Linear(dim, dim, bias=False),
                "wk": nn.Linear(dim, kv_dim, bias=False),
                "wv": nn.Linear(dim, kv_dim, bias=False),
                "wo": nn.Linear(dim, dim, bias=False),
            }
        )
        self.feed_forward = nn.ModuleDict(
            {
                "w1": nn.Linear(dim, hidden, bias=False),
                "w2": nn.Linear(hidden, dim, bias=False),
                "w3": nn.Linear(dim, hidden, bias=False),
            }
        )


class LlamaShapes(nn.Module):
    """The linear layers of a Llama: `n_layers` blocks plus the output projection."""

    def __init__(self, dim=4096, kv_dim=1024, hidden=14336, vocab=128256, n_layers=2):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(dim, kv_dim, hidden) for i in range(n_layers)})
        self.output = nn.Linear(dim, vocab, bias=False)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(nn.functional.silu(self.w1(self.norm(h))))


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> norm -> output: enough to learn a token pattern."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): MLPBlock(dim, hidden) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic values for every parameter, whatever device or subclass holds them."""
        gen = torch.Generator().manual_seed(seed)
        for name, param in sorted(self.named_parameters()):
            full = torch.randn(param.shape, generator=gen) * (0.02 if "weight" in name else 0.0)
            if "norm" in name:
                full = torch.ones(param.shape)
            if isinstance(param, DTensor):  # sharded by FSDP or TP: copy in this rank's shard
                full = distribute_tensor(full, param.device_mesh, param.placements)
            param.copy_(full)


def batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 0):
    """Sequences following a fixed random successor table (with some noise), so the loss falls."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(n):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        for t in range(seq):
            noise = torch.rand(batch, generator=gen) < 0.1
            tokens[:, t + 1] = torch.where(
                noise, torch.randint(vocab, (batch,), generator=gen), successor[tokens[:, t]]
            )
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train(model: nn.Module, data, hook=None, lr: float = 3e-3) -> list[float]:
    """AdamW on cross-entropy; returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for inputs, labels in data:
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if hook is not None:
            hook(model)
        losses.append(loss.item())
    return losses
