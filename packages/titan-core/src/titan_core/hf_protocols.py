"""How titan-ckpt meets a model's Hugging Face weight names without importing titan-models: a
family gives an `HFAdapter` (`ModelSpec.hf_adapter`), and one that converts box by box a
`SlicedHFAdapter`, with which each rank reads and writes only the parts its shards hold."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class HFAdapter(Protocol):
    """Converts a model's state dict to and from Hugging Face names and layouts.

    Optional, for checkpoints too large for one process: `to_hf_slices` and `from_hf_slice`
    (see `SlicedHFAdapter`), with which titan-ckpt has each rank read and write only the
    parts of the safetensors files its own shards hold."""

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` a Hugging Face loader needs for these weights."""


Box = tuple[slice, ...]
"""A rectangular part of a tensor: one `slice(start, stop)` per dimension (step 1), as a
rank's shard of a sharded parameter is."""


@dataclass(frozen=True)
class HFSlice:
    """A box of one Hugging Face tensor: its name, its full shape and the box (`index`)."""

    name: str
    shape: tuple[int, ...]
    index: Box


class SlicedHFAdapter(HFAdapter, Protocol):
    """An `HFAdapter` that converts one box of one tensor at a time: what each rank needs to
    import or export its own shards without ever holding the whole model.

    `name` is a tensor of ours, `shape` its full (global) shape and `index` the box of it a
    rank holds (a DTensor's local shard: FSDP, TP, EP, or a pipeline stage's whole tensor).
    The conversions are pure rearrangements (renames, transposes, stacking, joining,
    permuting rows), so each element of ours is one element of theirs; a tensor of ours that
    their format has no place for converts to no slices.
    """

    def to_hf_slices(
        self, name: str, shape: tuple[int, ...], index: Box, tensor: torch.Tensor
    ) -> list[tuple[HFSlice, torch.Tensor]]:
        """Where the box `index` of our tensor `name` (its values: `tensor`) goes in Hugging
        Face's tensors: the slices it covers, each with its values. Together the slices of
        every box of a tensor cover its Hugging Face tensors once."""

    def from_hf_slice(
        self,
        name: str,
        shape: tuple[int, ...],
        index: Box,
        read: Callable[[HFSlice], torch.Tensor],
    ) -> torch.Tensor:
        """The box `index` of our tensor `name`, built from the Hugging Face slices that
        `read` returns (only those the box needs, or a little more: whole attention heads).
        `read` raises KeyError for a name the checkpoint lacks."""


def is_sliced_hf_adapter(adapter: object) -> bool:
    """Whether `adapter` converts box by box (`SlicedHFAdapter`)."""
    return callable(getattr(adapter, "to_hf_slices", None)) and callable(
        getattr(adapter, "from_hf_slice", None)
    )
