"""A predicted step time for each rank role of a simulated job, priced on a system.

From the simulated step's work (`titan_trainer.dry_run.step_trace`) and a system
(`titan_trainer.dry_run.hardware`):

- compute: matmul and attention FLOPs at the device's peak for their dtype times the measured
  share real kernels reach (plus, for attention, a cost per score element where the system
  gives one: a CPU kernel's softmax), plus the bytes of every other operator at the memory
  bandwidth's share, plus a fixed cost per operator (launch and dispatch) and, where the
  system gives one, per operator on DTensors (their sharding propagation);
- communication: each collective as a ring with an alpha-beta cost: (n - 1) latencies and
  (n - 1) / n of the tensor at the bus bandwidth (twice for all-reduce), on the intra-node
  link when the group's ranks share a node, else on the inter-node link;
- overlap: FSDP's all-gathers and reduce-scatters and the data-parallel all-reduce run beside
  compute (prefetching), less one unhidden all-gather; a ring context parallel's exchanges
  hide behind attention; async TP's behind matmuls; everything else is exposed;
- pipeline bubble: (pp - 1) / (v x m) of the stage's work for m microbatches and v stages per
  rank, a third of that for zero-bubble schedules (their weight gradients fill most of it).

What it leaves out (docs/step_time.md): stragglers, network contention between jobs,
compilation's fusions, CPU-bound launch stalls beyond the fixed per-operator cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_trainer.dry_run.hardware import System
from titan_trainer.dry_run.step_trace import Collective, StepWork

# The order of the world mesh's dimensions, outermost first (titan_core.ParallelDims).
_MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class JobShape:
    """What the model needs to know of the job besides its step's work."""

    degrees: dict[str, int]
    """pp, dp_replicate, dp_shard, cp, tp, ep."""
    tokens_per_step: int
    """Tokens the whole job trains on per optimizer step."""
    world_size: int
    schedule: str = "1F1B"
    pp_microbatches: int = 1
    stages_per_rank: int = 1
    async_tp: bool = False
    cp_style: str | None = None


@dataclass
class Prediction:
    """One rank role's predicted step, in seconds."""

    role: str
    compute: float
    communication: float
    """All collectives, hidden or not."""
    exposed: float
    """The communication compute does not hide."""
    bubble: float
    model_flops: float
    """The step's FLOPs on this rank as MFU counts them (matmuls and attention, no recompute
    when the model's own count is given)."""
    peak: float
    by_group: dict[str, float]
    """Communication seconds per parallelism (fsdp, tp, ...)."""

    @property
    def step(self) -> float:
        return self.compute + self.exposed + self.bubble

    def share(self, part: str) -> float:
        return getattr(self, part) / self.step if self.step else 0.0


def group_stride(label: str, degrees: dict[str, int]) -> int:
    """The distance between neighbouring ranks of a parallelism's group in the world's rank
    order (the product of the mesh dimensions inside it)."""
    inner = {
        "tp": "tp",
        "cp": "cp",
        "fsdp": "dp_shard",
        "ep": "dp_shard",
        "dp": "dp_replicate",
        "pp": "pp",
    }.get(label, "tp")
    index = _MESH_ORDER.index(inner)
    stride = 1
    for name in _MESH_ORDER[index + 1 :]:
        if label in ("fsdp", "ep") and name == "cp":
            continue  # FSDP's and EP's groups span dp_shard x cp, flattened
        stride *= degrees.get(name, 1)
    return stride


def collective_seconds(c: Collective, system: System, degrees: dict[str, int]) -> float:
    """A ring's alpha-beta cost for every call of `c` (see the module docstring)."""
    n = c.ranks
    if n <= 1 or c.calls == 0:
        return 0.0
    within_node = group_stride(c.group, degrees) * n <= system.devices_per_node
    link = system.intra_node if within_node else system.inter_node
    if within_node and c.kind in system.links_by_kind:
        link = system.links_by_kind[c.kind]
    latencies, share = ring_terms(c.kind, n)
    return c.calls * latencies * link.latency_us * 1e-6 + c.bytes * share / (
        link.bandwidth_gbps * 1e9
    )


def ring_terms(kind: str, ranks: int) -> tuple[float, float]:
    """(latencies per call, the share of the tensor's bytes that crosses the link) of one
    collective of `kind` over `ranks` as a ring: n - 1 steps and (n - 1) / n of the tensor,
    twice for all-reduce (a reduce-scatter then an all-gather); one latency and the whole
    tensor for a send."""
    if kind == "send_recv":
        return 1.0, 1.0
    passes = 2 if kind == "all_reduce" else 1
    return passes * (ranks - 1), passes * (ranks - 1) / ranks


def compute_seconds(work: StepWork, system: System) -> tuple[float, float, float]:
    """(all compute, matmul part, attention part) of a step's work on `system`."""
    peak = system.peak(work.dtype) * system.compute_share
    matmul = work.matmul_flops / (peak * system.matmul_efficiency)
    attention = work.attention_flops / (peak * system.attention_efficiency)
    attention += work.attention_scores * system.attention_score_ns * 1e-9 / system.compute_share
    memory = work.memory_bytes / (
        system.memory_bandwidth_gbps * 1e9 * system.memory_efficiency * system.compute_share
    )
    overhead = (
        (
            work.compute_ops * system.op_overhead_us
            + work.dtensor_ops * system.dtensor_op_overhead_us
        )
        * 1e-6
        / system.compute_share
    )
    return matmul + attention + memory + overhead, matmul, attention


def pipeline_bubble(compute: float, shape: JobShape) -> float:
    pp = shape.degrees.get("pp", 1)
    if pp <= 1:
        return 0.0
    fraction = (pp - 1) / (max(shape.stages_per_rank, 1) * max(shape.pp_microbatches, 1))
    if shape.schedule in _ZERO_BUBBLE:
        fraction /= 3
    return compute * fraction


def predict(
    role: str, work: StepWork, shape: JobShape, system: System, model_flops: float | None = None
) -> Prediction:
    """The predicted step of one rank role. `model_flops`: this rank's share of the step's
    model FLOPs by the model's own count (without recomputation); else the traced FLOPs."""
    compute, matmul, attention = compute_seconds(work, system)
    by_group: dict[str, float] = {}
    for c in work.collectives:
        by_group[c.group] = by_group.get(c.group, 0.0) + collective_seconds(
            c, system, shape.degrees
        )
    exposed = 0.0
    for group, seconds in by_group.items():
        exposed += _exposed(group, seconds, work, shape, system, compute, matmul, attention)
    bubble = pipeline_bubble(compute + exposed, shape)
    return Prediction(
        role,
        compute,
        sum(by_group.values()),
        exposed,
        bubble,
        model_flops if model_flops is not None else work.flops,
        system.peak(work.dtype),
        by_group,
    )


def _exposed(group, seconds, work, shape, system, compute, matmul, attention) -> float:
    if not system.overlap:
        return seconds
    if group in ("fsdp", "dp"):
        # Prefetched behind the blocks' compute; the first all-gather of each microbatch's
        # forward (and the last reduce-scatter) has nothing to hide behind.
        calls = sum(c.calls for c in work.collectives if c.group == group) or 1
        unhidden = seconds / calls * 2
        return unhidden + max(0.0, seconds - unhidden - compute)
    if group == "tp" and shape.async_tp:
        return max(0.0, seconds - matmul)
    if group == "cp" and shape.cp_style == "ring":
        return max(0.0, seconds - attention)
    return seconds


def tokens_per_second_per_device(prediction_step: float, shape: JobShape) -> float:
    return shape.tokens_per_step / prediction_step / shape.world_size
