"""Stateful adapters that turn the trainer's objects into what DCP saves and loads.

Model and optimizer go through torch.distributed.checkpoint.state_dict, so FSDP/TP DTensor
shards are saved with their global layout and reshard on load. Per-rank states (RNG, the data
loader's position) get rank-specific keys so DCP's de-duplication of replicated values keeps
every rank's copy.
"""

from __future__ import annotations

import contextlib
import io
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titan_ckpt.safe_read import load_plain


def as_parts(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


class _Parts:
    """One module to hand to torch's state-dict API, plus the key renaming that keeps names
    identical to the unsplit model when a rank holds several pipeline stages.

    Several stages are wrapped in an nn.ModuleList, which prefixes every name with "<i>."; that
    prefix is stripped on the way out and put back on the way in, so a checkpoint saved with
    one stage per rank loads with two per rank and vice versa.
    """

    def __init__(self, parts: list[nn.Module]):
        self.parts = parts
        self.module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
        self._owner: dict[str, str] | None = None

    def strip(self, key: str, optimizer: bool = False) -> str:
        if len(self.parts) == 1:
            return key
        if optimizer:
            kind, rest = key.split(".", 1)
            return kind + "." + rest.split(".", 1)[1]
        return key.split(".", 1)[1]

    def add(self, key: str, optimizer: bool = False) -> str:
        if len(self.parts) == 1:
            return key
        if self._owner is None:
            self._owner = {}
            for k in get_model_state_dict(self.module):
                index, rest = k.split(".", 1)
                self._owner[rest] = index
        if optimizer:
            kind, rest = key.split(".", 1)
            fqn = rest.rsplit(".", 1)[0]  # optimizer state names ("exp_avg", "lr") have no dots
            return f"{kind}.{self._owner[fqn]}.{rest}"
        return f"{self._owner[key]}.{key}"


class ModelState:
    """The model's parameters and buffers; `dtype` casts floating tensors on save (exports).

    With `snapshot_buffers`, buffers are cloned when the state dict is taken: an async save may
    still be copying parameters while the next forward pass updates buffers in place.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], dtype: torch.dtype | None = None):
        self._parts = _Parts(as_parts(model))
        self.dtype = dtype
        self.snapshot_buffers = False

    def state_dict(self) -> dict[str, Any]:
        sd = get_model_state_dict(self._parts.module)
        out = {self._parts.strip(k): v for k, v in sd.items()}
        if self.snapshot_buffers:
            params = {_local(p).data_ptr() for p in self._parts.module.parameters()}
            out = {k: v if _local(v).data_ptr() in params else v.clone() for k, v in out.items()}
        if self.dtype is not None:
            out = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in out.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = {self._parts.add(k): v for k, v in state_dict.items()}
        set_model_state_dict(self._parts.module, sd, options=StateDictOptions(strict=True))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded tensors on CPU, on every rank (a collective under FSDP/TP)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(self._parts.module, options=options)
        return {self._parts.strip(k): v for k, v in sd.items()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load unsharded tensors (each rank keeps its own shard of them)."""
        sd = {self._parts.add(k): v for k, v in state_dict.items()}
        set_model_state_dict(
            self._parts.module, sd, options=StateDictOptions(full_state_dict=True, strict=True)
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OptimizerState:
    """The optimizer's state in torch's flattened, name-keyed form (`state.<fqn>.exp_avg`), which
    reshards like the parameters themselves."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer):
        self._parts = _Parts(as_parts(model))
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self._parts.module, self.optimizer, options=self._OPTIONS)
        return {self._parts.strip(k, optimizer=True): v for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = {self._parts.add(k, optimizer=True): v for k, v in state_dict.items()}
        with _gradients_set_aside(self.optimizer):
            set_optimizer_state_dict(self._parts.module, self.optimizer, sd, options=self._OPTIONS)


@contextlib.contextmanager
def _gradients_set_aside(optimizer: torch.optim.Optimizer):
    """No gradients while an optimizer that has never stepped loads a state dict. torch reads
    a flattened state into the slots the optimizer has; an optimizer without state gets them
    from a step at lr 0, which torch skips when any parameter holds a gradient, and then loads
    nothing: the moments and step counts stay empty, silently. A fault-tolerant replica group
    that receives the state of a live group after its own backward (it started late, or was
    restarted before its first checkpoint) hit that and drifted from the other groups."""
    if optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


class BlobState:
    """Any other Stateful (LR scheduler, loader, train state, RNG), saved as one serialised blob.

    DCP stores nested containers leaf by leaf and loads into the structure the object has *now*,
    so a state whose shape changes (an empty dict that later fills, a None that becomes a list)
    would not load. Serialising the state into one uint8 tensor keeps it exactly as it was; it
    is read back with `torch.load(weights_only=True)`, so it must hold tensors and plain values.

    `key` names the entry: "state" for states every rank shares (DCP keeps one copy), or a
    per-rank key ("dp3", "rank5") for states that differ between ranks.
    """

    def __init__(self, inner: Any, key: str = "state"):
        self.inner = inner
        self.key = key
        self.load_size: int | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.load_size is not None:  # a load: the target is sized from the checkpoint
            return {self.key: torch.empty(self.load_size, dtype=torch.uint8)}
        buffer = io.BytesIO()
        torch.save(self.inner.state_dict(), buffer)
        return {self.key: torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        data = state_dict[self.key].numpy().tobytes()
        self.inner.load_state_dict(load_plain(data, f"the saved state {self.key!r}"))
        self.load_size = None


class RNGState:
    """Python, torch CPU and CUDA generator states of this process."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python_version": version,
            "python_state": torch.tensor(internal, dtype=torch.int64),
            "python_gauss": gauss,
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        internal = tuple(int(x) for x in state_dict["python_state"].tolist())
        random.setstate((state_dict["python_version"], internal, state_dict["python_gauss"]))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


class TextState:
    """A piece of text saved with the checkpoint (the resolved config) and never loaded back."""

    def __init__(self, text: str):
        self.text = text

    def state_dict(self) -> str:
        return self.text

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
