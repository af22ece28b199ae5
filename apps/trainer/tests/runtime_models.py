"""Model plugins for the trainer's checks: `runtime_models:third_party_spec`, whose forward
takes only tokens (what a third-party family looks like), and
`runtime_models:leaky_block_causal_spec`, Llama 3 whose block-causal attention check runs the
FlexAttention path with a mask that ignores the documents (what a broken kernel or block mask
on a GPU would look like to the trainer)."""

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


def _leaky_block_causal_check(device: torch.device) -> list[str]:
    from unittest import mock

    from titan_models import attention

    def causal_only(ids):
        return lambda b, h, q, kv: q >= kv

    with mock.patch.object(attention, "same_document_and_causal", causal_only):
        return attention.check_block_causal(device, flex=True, backward=False)


def _leaky_spec() -> ModelSpec:
    import dataclasses

    from titan_models import llama3_spec

    return dataclasses.replace(llama3_spec, block_causal_check=_leaky_block_causal_check)


leaky_block_causal_spec = _leaky_spec()
