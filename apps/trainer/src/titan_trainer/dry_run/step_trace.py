"""What one simulated training step does, counted op by op: the work the step-time model
(`titan_trainer.dry_run.step_time`) prices.

`StepTrace` is a dispatch mode run around the dry run's simulated step (fake tensors, a fake
process group of the job's real size). Each operator lands in one kind:

- `matmul`: matrix products, FLOPs by torch's own counter (`torch.utils.flop_counter`);
- `attention`: fused attention kernels, FLOPs by the same counter, times the share of the
  query x key blocks a causal kernel computes (half on GPUs; on a CPU, by its kernel's tiling:
  all of it up to 512 positions), and the score elements they compute (query x key positions
  per head, the same share of them: the softmax's per-element work, which FLOPs do not see and
  which dominates a CPU kernel at small head dimensions);
- `memory`: every other operator that computes, priced by the bytes it reads and writes; in a
  compiled region, the intermediates inductor fuses away (`titan_parallel.compiled_memory`)
  cost neither traffic nor a kernel;
- a collective of one parallelism (`fsdp`, `tp`, `cp`, `ep`, `pp`, `dp`): bytes and ranks.

Operators on DTensors (tensor parallel's sharded parameters) are seen at their global shape;
their cost is divided by the ranks that share the work (the mesh dimensions the output is
sharded or partial over), and counted apart (DTensor's own dispatch costs per operator). Views,
metadata and allocation operators cost nothing else.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from titan_parallel.compiled_memory import counts_allocations

# Operators that move no data: views, metadata, allocation of uninitialised memory.
_FREE = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "t",
    "transpose",
    "permute",
    "as_strided",
    "slice",
    "select",
    "unsqueeze",
    "squeeze",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "detach",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "_to_copy_meta",
    "lift_fresh",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "record_stream",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "size",
    "stride",
}
_FREE_NAMESPACES = {"prim", "profiler", "c10d_functional_autograd"}
_ATTENTION = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention",
    "_efficient_attention",
    "flex_attention",
)
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}


@dataclass
class Collective:
    """Collectives of one kind on one group, summed over the step."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, send_recv, broadcast
    group: str  # the parallelism whose ranks it spans: fsdp, tp, cp, ep, pp, dp, ...
    ranks: int
    calls: int = 0
    bytes: int = 0
    """The full tensor each call moves: all-gather's output, reduce-scatter's input,
    all-reduce's tensor, all-to-all's input, a send's tensor."""


@dataclass
class StepWork:
    """One rank's simulated step, summed by kind."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    """What the kernels compute: a causal kernel's FLOPs times the share of blocks it computes
    (`_causal_share`); `attention_flops_full` counts them whole."""
    attention_flops_full: float = 0.0
    attention_scores: float = 0.0
    """Score elements (batch x heads x query x key positions) the attention kernels compute,
    forward and backward each counted, causal kernels' times the same share."""
    memory_bytes: float = 0.0
    compute_ops: int = 0
    """Operators that launch a kernel (every priced op but collectives)."""
    dtensor_ops: int = 0
    """Operators on DTensors (tensor parallel's), views included: each pays DTensor's dispatch
    (sharding propagation, unwrapping) on top of the local operator's."""
    collectives: list[Collective] = field(default_factory=list)
    dtype: str = "fp32"
    """The dtype most matmul FLOPs ran in (bf16, fp8, fp32)."""

    @property
    def flops(self) -> float:
        """Model FLOPs as MFU counts them: every matmul and attention FLOP, causal or not."""
        return self.matmul_flops + self.attention_flops_full

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepWork:
        """A recorded step's work (`to_dict`), for pricing it again without simulating."""
        fields = dict(data)
        fields["collectives"] = [Collective(**c) for c in data.get("collectives", [])]
        return cls(**fields)

    def add(self, other: StepWork, times: int = 1) -> None:
        """Adds `times` x `other`'s work to this."""
        for name in (
            "matmul_flops",
            "attention_flops",
            "attention_flops_full",
            "attention_scores",
            "memory_bytes",
        ):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))
        self.compute_ops += times * other.compute_ops
        self.dtensor_ops += times * other.dtensor_ops
        mine = {(c.kind, c.group, c.ranks): c for c in self.collectives}
        for c in other.collectives:
            entry = mine.setdefault(
                (c.kind, c.group, c.ranks), Collective(c.kind, c.group, c.ranks)
            )
            entry.calls += times * c.calls
            entry.bytes += times * c.bytes
        self.collectives = sorted(mine.values(), key=lambda c: (c.group, c.kind))


_GROUP_NAMES = {
    "dp_shard_cp": "fsdp",
    "dp_shard": "fsdp",
    "fsdp": "fsdp",
    "dp_replicate": "dp",
    "dp": "dp",
    "ep_fsdp": "fsdp",
    "ep_shard": "fsdp",
    "tp": "tp",
    "ep_tp": "ep",
    "ep": "ep",
    "cp": "cp",
    "pp": "pp",
}


def group_labels(dims) -> dict[str, str]:
    """The name of each process group of a built mesh -> the parallelism it serves. A group
    that serves data parallelism and another one (FSDP's dp_shard x cp group is the context
    parallel group itself when dp_shard is 1) is labelled with both, data parallelism first,
    joined by "+": `StepTrace` tells their collectives apart by how they are issued."""
    labels: dict[str, list[str]] = {}
    for role, label in _GROUP_NAMES.items():
        try:
            mesh = dims.mesh(role)
        except (AttributeError, KeyError, RuntimeError, ValueError):
            continue
        if mesh is None or mesh.ndim != 1:
            continue
        serves = labels.setdefault(mesh.get_group().group_name, [])
        if label not in serves:
            serves.append(label)
    return {
        name: "+".join(serves[:2]) if serves[0] in ("fsdp", "dp") else serves[0]
        for name, serves in labels.items()
    }


def _label_of_call(label: str, in_place: bool) -> str:
    """The parallelism one collective on a group labelled `label` serves: on a group shared
    by data parallelism and another, FSDP's and the replicas' collectives are c10d's in-place
    ops (their buffers are preallocated), the others' (DTensor's, context parallel's, expert
    parallel's) functional ones."""
    if "+" not in label:
        return label
    data, other = label.split("+", 1)
    return data if in_place else other


class StepTrace(TorchDispatchMode):
    """Counts the work of every operator run under it (see the module docstring), by phase:
    `with trace.phase("microbatch", repeat=accum): ...` counts one microbatch that the step
    repeats `accum` times (a later run of the same phase replaces an earlier one: the last,
    steady-state microbatch stands for all)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Counting must not stop compiled regions from compiling (dynamo skips frames under
        # modes that want every eager op); the simulation's compile backend runs their
        # partitioned graphs op by op, and those ops come through here all the same.
        return True

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        super().__init__()
        self.labels = labels or {}
        self.summary = StepWork()
        self._collectives: dict[tuple[str, str, int], Collective] = {}
        self._dtype_flops: dict[str, float] = defaultdict(float)
        self._phases: dict[str, tuple[StepWork, int]] = {}

    @contextlib.contextmanager
    def phase(self, name: str, repeat: int = 1) -> Iterator[None]:
        self.summary, self._collectives = StepWork(), {}
        with self:
            yield
        self._phases[name] = (self._finish(), repeat)

    def work(self) -> StepWork:
        """The whole step: each phase's work times its repeats."""
        total = StepWork()
        for work, repeat in self._phases.values():
            total.add(work, repeat)
        if self._dtype_flops:
            total.dtype = max(self._dtype_flops, key=self._dtype_flops.get)
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A cost the counter cannot read is a cost left out, never a crashed dry run.
        with contextlib.suppress(Exception):
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        namespace = func.namespace
        name = func._overloadpacket.__name__
        if namespace in _COLLECTIVE_NAMESPACES:
            self._collective(name, args, kwargs, out)
            return
        s = self.summary
        if _on_dtensors(args, out):
            s.dtensor_ops += 1
        if namespace in _FREE_NAMESPACES or name in _FREE:
            return
        packet = func._overloadpacket
        if packet not in flop_registry and not counts_allocations():
            return  # an intermediate inductor fuses into a neighbouring kernel: no traffic
        split = _work_split(out)
        s.compute_ops += 1
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out) / split
            if name.startswith(_ATTENTION):
                computed = _causal_share(name, args) if _is_causal(func, args, kwargs) else 1
                s.attention_flops_full += flops
                s.attention_flops += flops * computed
                s.attention_scores += _attention_scores(name, args) / split * computed
            else:
                s.matmul_flops += flops
                self._dtype_flops[_dtype_key(args)] += flops
            return
        s.memory_bytes += (_bytes(args) + _bytes(kwargs) + _bytes(out)) / split

    def _collective(self, name: str, args, kwargs, out) -> None:
        kind = _collective_kind(name)
        if kind is None:
            return
        group, ranks = self._group(args, kwargs)
        group = _label_of_call(group, in_place=name.endswith("_"))
        if not name.endswith("_"):  # functional: (input, ...) -> output
            moved = _bytes(out) if kind == "all_gather" else _bytes(args[0])
        elif kind == "reduce_scatter":  # c10d's in-place ops: (output, input, ...)
            moved = _bytes(args[1])
        else:
            moved = _bytes(args[0])
        key = (kind, group, ranks)
        entry = self._collectives.setdefault(key, Collective(kind, group, ranks))
        entry.calls += 1
        entry.bytes += int(moved)

    def _group(self, args, kwargs) -> tuple[str, int]:
        for value in [*args, *kwargs.values()]:
            pg = None
            if isinstance(value, str) and value in self.labels:
                return self.labels[value], _group_size(value)
            if isinstance(value, str):
                try:
                    pg = dist.distributed_c10d._resolve_process_group(value)
                except Exception:  # not a group's name
                    continue
            elif isinstance(value, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(value)
                except Exception:
                    continue
            if pg is not None:
                return self.labels.get(pg.group_name, "other"), pg.size()
        return "other", 1

    def _finish(self) -> StepWork:
        s = copy.copy(self.summary)
        s.collectives = sorted(self._collectives.values(), key=lambda c: (c.group, c.kind))
        return s


def _group_size(name: str) -> int:
    return dist.distributed_c10d._resolve_process_group(name).size()


def _collective_kind(name: str) -> str | None:
    name = name.lstrip("_")
    if "all_gather" in name or name.startswith("allgather"):
        return "all_gather"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "all_reduce" in name or name.startswith("allreduce"):
        return "all_reduce"
    if "all_to_all" in name or name.startswith("alltoall"):
        return "all_to_all"
    if name.startswith(("send", "recv")):
        return "send_recv"
    if name.startswith("broadcast"):
        return "broadcast"
    return None


def _on_dtensors(args, out) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tree_flatten((args, out))[0])


def _work_split(out) -> int:
    """Over how many ranks a DTensor op's global work is shared (1 for plain tensors)."""
    from torch.distributed.tensor import DTensor

    first = next((t for t in tree_flatten(out)[0] if isinstance(t, DTensor)), None)
    if first is None:
        return 1
    split = 1
    for size, placement in zip(first.device_mesh.shape, first.placements, strict=True):
        if placement.is_shard() or placement.is_partial():
            split *= size
    return split


def _bytes(tree) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
    )


def _dtype_key(args) -> str:
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                return "fp8"
            if t.dtype in (torch.bfloat16, torch.float16):
                return "bf16"
            return "fp32"
    return "fp32"


def _attention_scores(name: str, args) -> int:
    """Score elements of one attention call: batch x heads x query positions (the query's
    elements over its head dimension) x key positions (`_query_and_key`).
    `_scaled_dot_product_*` and flex attention lay them out (batch, heads, positions, head dim), the others (batch, positions,
    heads, head dim)."""
    pair = _query_and_key(name, args)
    if pair is None:
        return 0
    query, key = pair
    keys = key.shape[-3] if name.startswith(("_flash", "_efficient")) else key.shape[-2]
    return query.numel() // query.shape[-1] * keys


def _causal_share(name: str, args) -> float:
    """The share of a causal attention's query x key blocks its kernel computes. GPU flash
    kernels skip the masked blocks of small tiles: half. torch's CPU flash kernel tiles the
    queries in blocks of 32, 64 or 256 (by the query length: under 192, under 768, longer) and
    the keys in blocks of up to 512, and computes every key block a query block reaches in
    full: a whole square up to 512 positions, 0.75 of it at 1024, tending to half
    (`tests/test_step_time.py` times the kernel against this count)."""
    if not name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
        return 0.5
    pair = _query_and_key(name, args)
    if pair is None:
        return 0.5
    query, key = pair
    return cpu_flash_causal_share(int(query.shape[-2]), int(key.shape[-2]))


def _query_and_key(name: str, args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An attention call's query and key: its first two tensors, after the output's gradient
    for a backward; None where they are not the 4-d tensors the kernels take."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name.endswith("_backward"):
        tensors = tensors[1:]
    if len(tensors) < 2 or tensors[0].dim() != 4:
        return None
    return tensors[0], tensors[1]


def cpu_flash_causal_share(queries: int, keys: int) -> float:
    """See `_causal_share`: key positions computed over queries x keys."""
    q_block = 256 if queries >= 768 else 64 if queries >= 192 else 32
    kv_block = 512 if keys >= 512 else keys
    done = 0
    for start in range(0, queries, q_block):
        rows = min(q_block, queries - start)
        reached = min(start + rows, keys)
        done += rows * min(-(-reached // kv_block) * kv_block, keys)
    return done / (queries * keys)


def _is_causal(func, args, kwargs) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    schema = func._schema
    for i, argument in enumerate(schema.arguments):
        if argument.name == "is_causal" and i < len(args):
            return bool(args[i])
    return False
