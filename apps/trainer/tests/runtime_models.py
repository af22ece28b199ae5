"""Model plugins for the trainer's checks: `runtime_models:third_party_spec`, whose forward
takes only tokens (what a third-party family looks like),
`runtime_models:forward_with_document_ids_spec`, one that takes `document_ids` but has no
`block_causal_impl` to choose (its `ModelFeatures` say so), and
`runtime_models:leaky_block_causal_spec`, Llama 3 whose block-causal attention check runs the
FlexAttention path with a mask that ignores the documents (what a broken kernel or block mask
on a GPU would look like to the trainer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_core import ModelFeatures, ModelSpec


@dataclass(frozen=True)
class Args:
    """What a trainer reads of a flavor (`titan_core.ModelArgs`)."""

    vocab_size: int = 256
    max_seq_len: int = 2048
    n_mtp_layers: int = 0
    moe: None = None


class ThirdParty(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


third_party_spec = ModelSpec(name="third_party", flavors={"debugmodel": Args()}, build=ThirdParty)


class DocumentIds(ThirdParty):
    """A third-party model that takes `document_ids` (its own masking) but has no
    `block_causal_impl` to choose from."""

    def forward(self, tokens: torch.Tensor, document_ids=None) -> torch.Tensor:
        return self.embed(tokens)


forward_with_document_ids_spec = ModelSpec(
    name="document_ids",
    flavors={"debugmodel": Args()},
    build=DocumentIds,
    features=ModelFeatures(document_ids=True),
)


def _leaky_block_causal_check(device: torch.device, impl: str = "auto") -> list[str]:
    from unittest import mock

    from titan_models import block_causal

    def causal_only(ids, window=None):
        return lambda b, h, q, kv: q >= kv

    with mock.patch.object(block_causal, "same_document_and_causal", causal_only):
        return block_causal.check_block_causal(device, "flex", backward=False)


def _leaky_spec() -> ModelSpec:
    import dataclasses

    from titan_models import llama3_spec

    return dataclasses.replace(llama3_spec, block_causal_check=_leaky_block_causal_check)


leaky_block_causal_spec = _leaky_spec()
