"""Activation offload: the tensors a block saves for backward wait in host memory, not on the
device, between its forward and its backward.

`OffloadWrapper` wraps a block (like activation checkpointing's wrapper, its `state_dict` keys
are unchanged); while the block runs forward, every tensor autograd saves is copied to the
host and the device copy is dropped; backward copies it back when it needs it. On CUDA the
host buffers are pinned and both copies are asynchronous on the current stream (the caching
allocator does not reuse the device memory before the copy that reads it is done).

Kept on the device: parameters (they are there anyway), and tensor subclasses such as
tensor parallel's DTensors (their layout is not a plain host tensor). On a CPU the same copies
run (the code path is the one a GPU takes) and save nothing.

For memory estimates: inside `host_memory_separate()` (the dry run's simulation of a GPU on
the CPU), the host copies are left out of a memory tracker's count, as they are not device
memory, and their bytes are added up in `offloaded_bytes()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from titan_parallel.compiled_memory import _fused as _uncounted

_simulated = {"on": False, "bytes": 0}


class OffloadWrapper(ActivationWrapper):
    """A block whose saved activations live in host memory between forward and backward."""

    def forward(self, *args, **kwargs):
        copies = _HostCopies()
        try:
            with copies.hooks():
                return self._checkpoint_wrapped_module(*args, **kwargs)
        finally:
            copies.clear()


class _HostCopies:
    """The saved-tensor hooks of one block's forward. A tensor saved by several operations
    (a block's normalised input, read by three projections) is copied once."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, object]] = {}

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        # Keyed by identity, the tensor kept alongside so that its id is not reused while the
        # block runs forward.
        known = self._copies.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1]
        packed = _pack(tensor)
        self._copies[id(tensor)] = (tensor, packed)
        return packed

    def clear(self) -> None:
        # Autograd keeps the hooks (and so this object) with every saved tensor until
        # backward: the device tensors must not stay referenced here.
        self._copies.clear()


def _pack(tensor: torch.Tensor):
    # Wrapper subclasses (DTensor, Float8 tensors) keep a layout of their own; fake tensors
    # (a memory estimate's) are offloaded as the real ones would be.
    if isinstance(tensor, nn.Parameter) or is_traceable_wrapper_subclass(tensor):
        return tensor
    device = tensor.device
    pinned = device.type == "cuda"
    with _uncounted() if _simulated["on"] else contextlib.nullcontext():
        host = torch.empty(
            tensor.size(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            pin_memory=pinned,
            device="cpu",
        )
        host.copy_(tensor, non_blocking=pinned)
    if _simulated["on"]:
        _simulated["bytes"] += host.numel() * host.element_size()
    return device, host


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=device.type == "cuda")


def apply_activation_offload(model: nn.Module) -> None:
    """Wrap every block of `model.layers` in an `OffloadWrapper` (in place), outside any
    activation checkpointing wrapper. A checkpointed block keeps what it keeps itself (its
    input, selective checkpointing's op outputs), out of the hooks' reach: offload moves what
    plain autograd and compiled blocks save."""
    layers: nn.ModuleDict = model.layers
    for name, block in list(layers.items()):
        layers[name] = OffloadWrapper(block)


@contextlib.contextmanager
def host_memory_separate() -> Iterator[None]:
    """Within this block, offloaded copies are host memory apart from the (simulated) device's:
    not counted by a memory tracker, added to `offloaded_bytes()` instead (reset on entry)."""
    before = dict(_simulated)
    _simulated.update(on=True, bytes=0)
    try:
        yield
    finally:
        _simulated["on"] = before["on"]


def offloaded_bytes() -> int:
    """Bytes copied to the host by offloading blocks in the last `host_memory_separate()`."""
    return _simulated["bytes"]
