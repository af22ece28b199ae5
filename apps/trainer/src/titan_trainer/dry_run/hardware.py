"""The systems a dry run can price a step on: one small TOML file per system.

A system is its device (dense peak per dtype, memory bandwidth), how many devices share a
node, its two links (within a node, between nodes; each a bus bandwidth and a latency), and
the shares of peak that real kernels reach (`[efficiency]`), each with where the figure comes
from (`[provenance]`). Titan ships files for common systems in `systems/`; a team adds its own
by pointing `[dry_run] system` at a file of the same shape (see docs/step_time.md). `cpu`
measures this machine instead (`titan_trainer.dry_run.cpu_system`).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from titan_core import ConfigError

SYSTEMS_DIR = Path(__file__).parent / "systems"

# `[dry_run] device` -> the system priced when `system = "auto"`.
_BY_DEVICE = {"H100": "h100_sxm", "H200": "h200", "A100": "a100_sxm", "A100-40GB": "a100_sxm"}


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float
    """Bus bandwidth per device in GB/s (what nccl-tests calls busbw)."""
    latency_us: float
    """Per step of a ring, in microseconds."""


@dataclass(frozen=True)
class System:
    name: str
    device: str
    devices_per_node: int
    peak_tflops: dict[str, float]
    memory_bandwidth_gbps: float
    matmul_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    op_overhead_us: float
    intra_node: Link
    inter_node: Link
    dtensor_op_overhead_us: float = 0.0
    """Microseconds each operator on DTensors costs beyond `op_overhead_us` (DTensor's
    sharding propagation in Python): measured on CPUs; 0 where it hides behind the device."""
    attention_score_ns: float = 0.0
    """Nanoseconds per attention score element beyond its FLOPs (the softmax's exponentials and
    rescaling): measured on CPUs, where it dominates at small head dimensions; hidden under
    the matmuls on GPUs (0)."""
    overlap: bool = True
    """Whether communication runs beside computation (GPU streams); a CPU's does not."""
    compute_share: float = 1.0
    """The share of a device each rank gets (CPU processes sharing cores)."""
    links_by_kind: dict[str, Link] = field(default_factory=dict)
    """A link per collective kind (all_gather, reduce_scatter, ...), priced in place of the
    intra-node one: a measured system's (gloo implements each collective its own way, some
    far slower than a ring); empty for the shipped GPU systems, whose ring collectives share
    one bus bandwidth."""
    provenance: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (bf16, fp8, fp32); fp8 falls back to bf16."""
        for key in (dtype, "bf16" if dtype == "fp8" else dtype, "fp32"):
            if key in self.peak_tflops:
                return self.peak_tflops[key] * 1e12
        raise ConfigError(f"system {self.name!r} gives no peak for {dtype}")


def auto_system(device: str) -> str | None:
    """The shipped system `auto` takes for `[dry_run] device`; None where none describes it."""
    return _BY_DEVICE.get(device)


def shipped_systems() -> list[str]:
    return sorted(p.stem for p in SYSTEMS_DIR.glob("*.toml"))


def load_system(name: str, device: str = "H100") -> System:
    """A shipped system by name, a TOML file by path, or `auto` (the shipped system of
    `device`). `cpu`, this machine measured, is `titan_trainer.dry_run.cpu_system`'s."""
    if name == "auto":
        key = auto_system(device)
        if key is None:
            raise ConfigError(
                f"[dry_run] device = {device!r} has no shipped system to price a step on\n"
                f"set [dry_run] system to one of {', '.join(shipped_systems())} or to a TOML"
                " file describing yours (docs/step_time.md)"
            )
        name = key
    path = Path(name)
    if not path.suffix:
        path = SYSTEMS_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(
            f"[dry_run] system = {name!r} is neither a shipped system nor a file\n"
            f"use one of {', '.join(shipped_systems())}, cpu, auto, or a path to a TOML file"
        )
    return parse_system(tomllib.loads(path.read_text()), str(path))


def parse_system(data: dict, source: str = "") -> System:
    """A `System` from a TOML file's contents; a missing or bad field is named."""

    def need(table: dict, key: str, where: str):
        if key not in table:
            raise ConfigError(f"{source}: [{where}] has no {key}\nadd it (see docs/step_time.md)")
        value = table[key]
        if isinstance(value, (int, float)) and value <= 0:
            raise ConfigError(f"{source}: [{where}] {key} = {value} must be positive")
        return value

    eff = data.get("efficiency", {})
    links = data.get("links", {})
    for name in ("intra_node", "inter_node"):
        if name not in links:
            raise ConfigError(f"{source}: no [links.{name}]\nadd its bandwidth_gbps and latency_us")
    for key in ("matmul", "attention", "memory"):
        value = need(eff, key, "efficiency")
        if value > 1:
            raise ConfigError(
                f"{source}: [efficiency] {key} = {value} is a share of peak\nuse a value in (0, 1]"
            )
    return System(
        name=need(data, "name", "top level"),
        device=need(data, "device", "top level"),
        devices_per_node=int(need(data, "devices_per_node", "top level")),
        peak_tflops=dict(need(data, "peak_tflops", "top level")),
        memory_bandwidth_gbps=float(need(data.get("memory", {}), "bandwidth_gbps", "memory")),
        matmul_efficiency=float(eff["matmul"]),
        attention_efficiency=float(eff["attention"]),
        memory_efficiency=float(eff["memory"]),
        op_overhead_us=float(eff.get("op_overhead_us", 0.0)),
        intra_node=_link(links["intra_node"], "links.intra_node", need),
        inter_node=_link(links["inter_node"], "links.inter_node", need),
        attention_score_ns=float(eff.get("attention_score_ns", 0.0)),
        dtensor_op_overhead_us=float(eff.get("dtensor_op_overhead_us", 0.0)),
        overlap=bool(data.get("overlap", True)),
        compute_share=float(data.get("compute_share", 1.0)),
        provenance={k: str(v) for k, v in data.get("provenance", {}).items()},
        source=source,
    )


def _link(table: dict, where: str, need) -> Link:
    return Link(
        float(need(table, "bandwidth_gbps", where)), float(need(table, "latency_us", where))
    )
