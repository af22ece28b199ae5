"""Per-rank memory of a training step, measured without the hardware (or with it).

A rank of a 512-GPU job can be simulated in one CPU process: a fake process group of the real
world size (collectives return at once), fake tensors (shapes and dtypes, no storage), and the
real parallelize path on the model at its full size. PyTorch's own memory trackers
(`torch.distributed._tools`) then count every tensor the step creates, by kind, and report the
peak. The same tracker runs on real tensors too, which is how the estimate is validated.

    with fake_process_group(world_size=64, rank=0):
        dims = ParallelDims(64, tp=8)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = MyModel()
        parallelize(model, dims, ...)
        with fake_tensors():
            model.to_empty(device="cpu")
            init_weights_exact(model, seed=0)
            optimizer = torch.optim.AdamW(model.parameters())
            peak = estimate_step_memory([model], optimizer, lambda: train_step(model, optimizer))
    print(peak.describe())

Compiled regions are counted as inductor would run them when they were compiled with
`simulated_backend()` (see `titan_parallel.compiled_memory`): what its partitioner saves for
backward, without the intermediates its fused kernels never write. A step simulated for GPUs
on the CPU runs under `cuda_kernels()`, where CUDA's kernels keep less than the CPU's (see
`titan_parallel.cuda_kernels`).

What the estimate leaves out: the CUDA caching allocator's fragmentation and reserve, the
CUDA context and NCCL's own buffers (a few GiB per GPU: keep headroom).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from titan_parallel.compiled_memory import compiled_regions_traceable, counts_allocations

GiB = 1024**3

# torch's tracker category names -> ours.
_CATEGORIES = {
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer",
    "Optstate": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Other": "temporaries",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes in use at the peak of a step, by kind."""

    parameters: int = 0
    """Parameter shards, gathered (unsharded) parameters and buffers."""
    gradients: int = 0
    optimizer: int = 0
    """Optimizer state (AdamW: two moments per parameter)."""
    activations: int = 0
    """Saved for backward (and the step's inputs)."""
    temporaries: int = 0
    """Created and freed within forward or backward (activation gradients, loss buffers)."""
    communication: int = 0
    """FSDP's all-gather and reduce-scatter buffers."""

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, int]) -> MemoryBreakdown:
        sums = dict.fromkeys((f.name for f in fields(cls)), 0)
        for name, nbytes in snapshot.items():
            if name != "Total":
                sums[_CATEGORIES.get(name, "temporaries")] += int(nbytes)
        return cls(**sums)

    def gib(self) -> dict[str, float]:
        """Every kind and the total, in GiB."""
        out = {f.name: getattr(self, f.name) / GiB for f in fields(self)}
        out["total"] = self.total / GiB
        return out

    def describe(self) -> str:
        return " | ".join(f"{k} {v:.2f} GiB" for k, v in self.gib().items())


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group for this block is a fake one of `world_size` ranks, this
    process being `rank`: meshes of the real size can be built and every collective returns at
    once without moving data. Needs no other process and no network."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a process group already exists in this process; simulate in a fresh process"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors() -> Iterator[None]:
    """Tensors created in this block are fake: shapes, dtypes and devices without storage.

    `to_empty`, initialisation, forward, backward and the optimizer step of a 405B model then
    cost no memory. Tensors that already exist (meta parameters, meshes) may be used as inputs.
    DTensor computes each op's output shape by running it on fake tensors of the *global* shape;
    those runs are moved to a separate fake mode so that a memory tracker does not count them.
    A fused optimizer step's sharding is propagated in linear time (see
    `titan_parallel.foreach_sharding`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_parallel.foreach_sharding import linear_foreach_sharding

    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        _isolated_sharding_propagation(),
        linear_foreach_sharding(),
    ):
        yield


@contextlib.contextmanager
def _isolated_sharding_propagation() -> Iterator[None]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def isolated(self, op_schema):
        with FakeTensorMode():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = isolated
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


class _ForgetModules(WeakIdKeyDictionary):
    """Module statistics that never count `modules` as already seen."""

    def __init__(self, modules: Sequence[nn.Module]):
        super().__init__()
        self._forget = {id(m) for m in modules}

    def __contains__(self, key) -> bool:
        return id(key) not in self._forget and super().__contains__(key)


def _update_global_peak(tracker, _peak_state) -> None:
    for device, snapshot in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(device, 0) < snapshot["Total"]:
            tracker._peak_mem[device] = snapshot["Total"]
            tracker._peak_mem_snap[device] = dict(snapshot)


def _sees_compiled_code(tracker_class: type) -> type:
    """`tracker_class` that counts what compiled regions allocate.

    Its dispatch mode lets torch.compile run (by default dynamo skips compiled code while a
    dispatch mode is active, and the region would run eagerly): compilation happens with the
    tracker off and the compiled graphs' operations run under it. Under the simulation
    backend (`titan_parallel.compiled_memory`), what inductor would fuse away is not counted.
    """

    class Tracker(tracker_class):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not counts_allocations():
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        # FSDPMemTracker wraps each FSDP module's forward hooks with its own. FSDP's hooks are
        # hidden from dynamo; the wrappers must be too, or dynamo would compile them as frames
        # of the compiled module's call.
        def _fsdp_state_pre_forward(self, *args, **kwargs):
            return torch._dynamo.disable(super()._fsdp_state_pre_forward(*args, **kwargs))

        def _fsdp_state_post_forward(self, *args, **kwargs):
            return torch._dynamo.disable(super()._fsdp_state_post_forward(*args, **kwargs))

    Tracker.__name__ = Tracker.__qualname__ = tracker_class.__name__
    return Tracker


class StepMemoryTracker:
    """Counts the memory of everything run inside `with tracker:` by kind, on real or fake
    tensors, for one or several model parts (pipeline stages) and their optimizer.

    FSDP-wrapped parts get torch's FSDPMemTracker (which also sees gathered parameters and
    communication buffers); others get its generic MemTracker.
    """

    def __init__(self, parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        parts = list(parts)
        if any(isinstance(p, FSDPModule) for p in parts):
            tracker = _sees_compiled_code(FSDPMemTracker)(
                next(p for p in parts if isinstance(p, FSDPModule)), optimizer
            )
            # FSDPMemTracker instruments the FSDP modules under one root; a pipeline rank
            # holds several roots, so hand it a container of all of them.
            tracker._root_mod = nn.ModuleList(parts)
        else:
            tracker = _sees_compiled_code(MemTracker)()
            tracker.track_external(*parts, *([optimizer] if optimizer is not None else []))
        # torch's trackers take a second forward call of a top-level module for the start of
        # the next iteration and refuse it; a pipeline stage is called once per microbatch.
        # Per-module statistics are not used here, so the parts are never remembered as seen.
        tracker.memory_tracking = _ForgetModules(parts)
        # After every op torch's tracker also updates each tracked module's own peak, a loop
        # over every module per op that dominates a large simulation; only the global peak is
        # used here.
        tracker._update_peak_stats = functools.partial(_update_global_peak, tracker)
        self._tracker = tracker
        self._parts = parts
        self._compiled = contextlib.ExitStack()

    def __enter__(self) -> StepMemoryTracker:
        self._compiled.enter_context(compiled_regions_traceable(self._parts))
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        self._compiled.close()

    def peak(self) -> MemoryBreakdown:
        """The breakdown at the moment of highest total use (one device)."""
        return self._pick(self._tracker.get_tracker_snapshot("peak"))

    def current(self) -> MemoryBreakdown:
        return self._pick(self._tracker.get_tracker_snapshot("current"))

    @staticmethod
    def _pick(snapshot: dict) -> MemoryBreakdown:
        if not snapshot:
            return MemoryBreakdown()
        per_device = max(snapshot.values(), key=lambda s: s.get("Total", 0))
        return MemoryBreakdown.from_snapshot(per_device)


def estimate_step_memory(
    parts: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    step: Callable[[], object],
    *,
    warmup_steps: int = 1,
) -> MemoryBreakdown:
    """Peak memory of one training step `step()` (forward, backward, optimizer) by kind.

    `warmup_steps` steps run untracked first, so that the measured step is a steady-state one:
    optimizer state exists, and DTensor's sharding decisions are cached (on fake tensors their
    first computation would otherwise be counted).
    """
    with warnings.catch_warnings():
        # Under the tracker, functional collectives (expert parallel's all-to-all) return
        # views, and FSDP warns that a module returned one; nothing modifies them in place.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
        for _ in range(warmup_steps):
            step()
        tracker = StepMemoryTracker(parts, optimizer)
        with tracker:
            step()
    return tracker.peak()


def estimate_init_memory(parts: Sequence[nn.Module], init: Callable[[], object]) -> int:
    """Peak bytes while `init()` materialises and initialises `parts` (which must already
    exist on the device, e.g. after `to_empty`): the parameter shards plus whatever the
    initialisation holds beyond them."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*parts)
    with tracker:
        init()
    snapshot = tracker.get_tracker_snapshot("peak")
    return max((s.get("Total", 0) for s in snapshot.values()), default=0)


def resident_bytes(
    parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Bytes of what persists between steps on this rank: parameter shards, buffers,
    gradients and optimizer state (each storage counted once)."""
    from torch.distributed.tensor import DTensor

    tensors: list[torch.Tensor] = []
    for part in parts:
        tensors += list(part.parameters()) + list(part.buffers())
        tensors += [p.grad for p in part.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += [
            v
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
