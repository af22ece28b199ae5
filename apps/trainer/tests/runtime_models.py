"""A model plugin (`runtime_models:third_party_spec`) whose forward takes only tokens: what a
third-party family looks like to the trainer's checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_core import ModelSpec


@dataclass(frozen=True)
class Args:
    vocab_size: int = 256


class ThirdParty(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


third_party_spec = ModelSpec(name="third_party", flavors={"debugmodel": Args()}, build=ThirdParty)
