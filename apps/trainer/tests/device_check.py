"""Find, on a CPU, the tensors that a GPU run would hand to NCCL from host memory.

On a GPU a tensor is on the GPU only when the code put it there: made with `device=`, moved
with `.to(device)`, or computed from tensors that are there (parameters, a batch after
`.to(device)`). One made without `device=` (`torch.tensor([1])`, `torch.zeros(())`) or
brought back with `.cpu()` stays in host memory, and NCCL refuses to reduce it ("No backend
type associated with device type cpu"). On a CPU both are the same memory, so a CPU run shows
nothing; `CollectiveDeviceCheck` shows it by keeping track of where each tensor would be:

- host: made by a factory without `device=`, by `torch.from_numpy`, or by `.cpu()`;
- device: made with an explicit device, moved with `.to(<device>)`, created before the check
  started (parameters), or computed from at least one device tensor (as CUDA promotes a
  host scalar);

and records every collective (`torch.distributed.*` and functional collectives, which
DTensor uses) that is handed a host tensor, and every in-place op that writes a device
tensor into a host one. Code that branches on `tensor.device.type` is seen taking its CPU
branch, so keep such branches out of code that feeds collectives.
"""

from __future__ import annotations

import functools
import traceback
import weakref

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)


def _tensors(*trees) -> list[torch.Tensor]:
    return [t for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor)]


_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")

_IN_PLACE_OPERATORS = {
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor")
}


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args)


class CollectiveDeviceCheck(TorchFunctionMode):
    """Use as a context manager around code to check; `violations` lists what a GPU run
    would refuse, with the place in the code."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self.collectives = 0
        """Collectives seen, checked or not."""
        self._host: dict[int, weakref.ref] = {}
        self._patched: dict[str, object] = {}
        self._factories = _device_constructors() | {torch.from_numpy}

    # ------------------------------------------------------------------ where tensors are
    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _mark(self, t: torch.Tensor, host: bool) -> None:
        if host:
            key = id(t)
            self._host[key] = weakref.ref(t, lambda _, key=key: self._host.pop(key, None))
        else:
            self._host.pop(id(t), None)

    def _record(self, what: str) -> None:
        # The innermost frame outside this module and torch: the code under test.
        frames = [
            f
            for f in traceback.extract_stack()
            if not f.filename.endswith("device_check.py") and "/torch/" not in f.filename
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.violations.append(f"{what} at {where}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        name = getattr(func, "__name__", "")
        namespace, _, op = str(func).partition(".")
        if namespace == "_c10d_functional" and not op.startswith(_NOT_COLLECTIVES):
            self._check_collective(str(func), inputs)
        in_place = (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS
        if in_place and inputs:
            target, others = inputs[0], inputs[1:]
            if self.is_host(target) and any(not self.is_host(o) for o in others):
                self._record(f"{name} writes a device tensor into a host tensor")
        out = func(*args, **kwargs)
        if func in self._factories:
            host = func is torch.from_numpy or kwargs.get("device") is None
        elif name == "cpu":
            host = True
        elif name == "cuda":
            host = False
        elif name == "to" or name.startswith("new_"):
            like = [a for a in args[1:] if isinstance(a, torch.Tensor)]  # x.to(other)
            if like:
                host = self.is_host(like[0])
            else:
                host = not _names_a_device(args[1:], kwargs) and self.is_host(inputs[0])
        else:
            host = bool(inputs) and all(self.is_host(t) for t in inputs)
        if isinstance(out, torch.Tensor) and inputs and out is inputs[0]:
            if name not in ("to", "cuda", "cpu") or host == self.is_host(out):
                return out  # in place, or no move: the tensor stays where it was
            # A move between host and device returns the tensor itself on a CPU, a copy on a
            # GPU: copy here too, so that the original keeps its place.
            out = out.clone()
        for t in _tensors(out):
            self._mark(t, host)
        return out

    # ------------------------------------------------------------------ collectives
    def _check_collective(self, what: str, tensors: list[torch.Tensor]) -> None:
        self.collectives += 1
        host = [t for t in tensors if self.is_host(t)]
        if host:
            shapes = ", ".join(str(tuple(t.shape)) for t in host)
            self._record(f"{what} is handed a host tensor {shapes}")

    def _wrap(self, name: str):
        original = getattr(dist, name)

        @functools.wraps(original)
        def checked(*args, **kwargs):
            self._check_collective(f"torch.distributed.{name}", _tensors(args, kwargs))
            return original(*args, **kwargs)

        return checked

    def __enter__(self):
        for name in _COLLECTIVES:
            self._patched[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(dist, name, original)
        self._patched.clear()
        return super().__exit__(*exc)
