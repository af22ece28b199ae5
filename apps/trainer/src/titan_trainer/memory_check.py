"""The memory check a run makes before it allocates anything: does this rank's state
(parameter shards, their gradients, the optimizer's copies) plus a step's activations fit in
the memory its device has free, and, on a CPU, do the ranks that share this host fit in it
together?

Cheap by design (a second or so): the state is counted from the rank's meta-device parts; the
activations are measured on fake tensors, one forward pass of the model with one block of each
kind, at the run's local batch and sequence length, counting what autograd saves for the
backward pass, and scaled to the rank's blocks and activation checkpointing. `--dry-run`
simulates the whole step per rank; this check only stops what cannot fit.
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core import MemoryMonitor, ParallelDims, get_logger
from titan_parallel.memory_estimate import fake_tensors
from titan_trainer.model import build_meta_model, model_spec

log = get_logger("memory")
GiB = 1024**3


@dataclass(frozen=True)
class Activations:
    """Bytes a step's forward pass keeps for the backward pass on one rank."""

    low: int
    """What must be kept however activation checkpointing recomputes (each block's input,
    what lies outside the blocks, and one block's worth while it is recomputed)."""
    high: int
    """What is kept with this run's activation checkpointing: equal to `low` with none or
    full; without any recomputation for selective (an upper bound)."""


@dataclass(frozen=True)
class RankNeed:
    state: int
    """Parameter shards, their gradients and the optimizer's copies, in bytes."""
    activations: Activations | None
    """None when they could not be measured here (pipeline parallel: see --dry-run)."""

    @property
    def low(self) -> int:
        return self.state + (self.activations.low if self.activations else 0)

    @property
    def high(self) -> int:
        return self.state + (self.activations.high if self.activations else 0)


def state_bytes(parts, optimizer_states: float) -> int:
    """Parameter shards of this rank's parts (counted on the meta device), their gradients and
    `optimizer_states` parameter-sized copies."""
    nbytes = 0
    for part in parts:
        for p in part.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            nbytes += int(local.numel() * local.element_size() * (2 + optimizer_states))
    return nbytes


def activation_bytes(
    config, dims: ParallelDims, vocab_size: int, device, dtype, model: nn.Module | None = None
) -> Activations:
    """A step's activations on one rank, measured on fake tensors (see the module docstring).
    Tensor and context parallel split them over their ranks (sequence parallel the rest).
    `model`: the full model on the meta device, which this changes (built when not given)."""
    if model is None:
        model = build_meta_model(model_spec(config), config, vocab_size)
    kinds = _block_kinds(model)
    t = config.training
    outside, per_kind, inputs = _saved_bytes(
        model, kinds, t.local_batch_size, t.seq_len, device, dtype
    )
    blocks = sum(count * per_kind[key] for key, (_, count) in kinds.items())
    kept_inputs = sum(count * inputs[key] for key, (_, count) in kinds.items())
    largest = max(per_kind.values(), default=0)
    full = outside + kept_inputs + largest
    none = outside + blocks
    mode = config.activation_checkpoint.mode
    low, high = {"none": (none, none), "full": (full, full)}.get(mode, (min(full, none), none))
    split = dims.tp * dims.cp
    return Activations(low // split, high // split)


def _block_kinds(model: nn.Module) -> dict[tuple, tuple[str, int]]:
    """Blocks of `model.layers` grouped by their parameters' names and shapes (dense and
    mixture-of-experts blocks differ): kind -> (the first block's key, how many)."""
    kinds: dict[tuple, tuple[str, int]] = {}
    for key, block in model.layers.items():
        kind = (
            type(block).__name__,
            tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
        )
        first, count = kinds.get(kind, (key, 0))
        kinds[kind] = (first, count + 1)
    return kinds


def _saved_bytes(model, kinds, batch: int, seq_len: int, device, dtype):
    """One forward pass and the loss, with one block of each kind, on fake tensors: bytes saved
    for backward outside the blocks, inside each kind's block, and each block's input."""
    keep = {first for first, _ in kinds.values()}
    for key in [k for k in model.layers if k not in keep]:
        del model.layers[key]
    owner = {first: kind for kind, (first, _) in kinds.items()}
    per_kind = dict.fromkeys(kinds, 0)
    inputs = dict.fromkeys(kinds, 0)
    outside = 0
    current: list[tuple] = []
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            if current:
                per_kind[current[-1]] += storage.nbytes()
            else:
                outside += storage.nbytes()
        return tensor

    def enter(kind):
        def hook(_module, args):
            current.append(kind)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):
                inputs[kind] = first.numel() * first.element_size()

        return hook

    def leave(_module, _args, _output) -> None:
        current.pop()

    for key, kind in owner.items():
        model.layers[key].register_forward_pre_hook(enter(kind))
        model.layers[key].register_forward_hook(leave)
    autocast = (
        torch.autocast(device.type, dtype=dtype)
        if dtype != torch.float32
        else contextlib.nullcontext()
    )
    # Warnings of the fake run (dtype mismatches under autocast) are not the user's business.
    with fake_tensors(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.to_empty(device=device)
        tokens = torch.zeros((batch, seq_len), dtype=torch.long, device=device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            logits = model(tokens)
            F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(0, 1))
    return outside, per_kind, inputs


def rank_need(
    config, parts, dims: ParallelDims, vocab_size: int, device, dtype, copies, model=None
) -> RankNeed:
    """This rank's need: its state, and a step's activations where they can be measured
    (`model`: a meta-device copy of the full model that the measure may change)."""
    activations = None
    if not dims.pp_enabled:  # a stage's microbatches in flight: the dry run knows them
        try:
            activations = activation_bytes(config, dims, vocab_size, device, dtype, model)
        except Exception as e:  # noqa: BLE001 - a model fake tensors cannot run: state only
            log.debug("activations not estimated: %s: %s", type(e).__name__, e)
    return RankNeed(state_bytes(parts, copies), activations)


def host_needs(need: RankNeed, device: torch.device) -> list[RankNeed]:
    """The needs of every rank whose memory is this host's: on a CPU every rank of the job on
    this host (gathered over the default process group); on an accelerator this rank's own."""
    if device.type != "cpu" or not dist.is_initialized() or dist.get_world_size() == 1:
        return [need]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), need))
    host = socket.gethostname()
    return [n for name, n in gathered if name == host]


def memory_problem(
    config, needs: list[RankNeed], device: torch.device
) -> tuple[str | None, str | None]:
    """(why the job cannot start here, or None; a warning that it may not fit, or None).
    `needs` are the ranks that share this device's memory (see `host_needs`)."""
    free = free_bytes(device)
    low, high = sum(n.low for n in needs), sum(n.high for n in needs)
    if low <= free and high <= free:
        return None, None
    text = _describe(config, needs, device, free)
    fixes = _fixes(config, needs)
    if low > free:
        return f"{text}\n{fixes}", None
    return None, f"{text}; it may not fit\n{fixes}"


def _describe(config, needs: list[RankNeed], device: torch.device, free: int) -> str:
    mine = needs[0]
    act = mine.activations
    t = config.training
    parts = [f"{mine.state / GiB:.1f} GiB for its parameters, gradients and optimizer state"]
    if act is not None:
        span = (
            f"{act.low / GiB:.1f}"
            if act.low == act.high
            else f"{act.low / GiB:.1f}-{act.high / GiB:.1f}"
        )
        parts.append(
            f"about {span} GiB for a step's activations (local batch {t.local_batch_size} x"
            f" seq_len {t.seq_len:,}, activation checkpointing"
            f" {config.activation_checkpoint.mode})"
        )
    each = " and ".join(parts)
    where = "the host" if device.type == "cpu" else device.type
    if len(needs) == 1:
        total = f"this rank needs {mine.low / GiB:.1f} GiB" + (
            f" to {mine.high / GiB:.1f} GiB" if mine.high != mine.low else ""
        )
        return f"{total}: {each}; {where} has {free / GiB:.1f} GiB free"
    low, high = sum(n.low for n in needs), sum(n.high for n in needs)
    total = f"{low / GiB:.1f} GiB" + (f" to {high / GiB:.1f} GiB" if high != low else "")
    return (
        f"the {len(needs)} processes on this host need {total} together (this rank {each});"
        f" {where} has {free / GiB:.1f} GiB free"
    )


def _fixes(config, needs: list[RankNeed]) -> str:
    fixes = []
    act = needs[0].activations
    if act is not None and act.high > needs[0].state / 4:
        fixes.append("lower [training] seq_len or local_batch_size")
        if config.activation_checkpoint.mode != "full":
            fixes.append("turn on activation checkpointing (--activation_checkpoint.mode full)")
    fixes.append("shard over more ranks (FSDP, TP, CP, PP)")
    if len(needs) > 1:
        fixes.append("start fewer processes on this host (NGPU, --nproc_per_node)")
    return "; ".join(fixes) + "; plan the layout with --dry-run"


def free_bytes(device: torch.device) -> int:
    """Memory free for this job: the accelerator's free memory, or the host's available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(MemoryMonitor(device).stats().total_gib * GiB)
