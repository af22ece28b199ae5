"""Process-group setup: under torchrun, or as a plain single process without it."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_core.compat import note_missing
from titan_core.device import local_device, process_group_backend
from titan_core.network import point_gloo_at


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str


def init_distributed(
    device_type: str,
    timeout_seconds: float = 300.0,
    *,
    trace_buf_size: int | None = None,
    trace_dir: str | os.PathLike | None = None,
) -> DistInfo:
    """Initialise the default process group for `device_type`.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) this joins the job. Started as a plain
    `python` process, it creates a one-process group over an in-memory store, so that code
    written for meshes and DTensors runs unchanged on one process. Either way the group is
    `process_group_backend(device_type)`: on an accelerator, gloo serves CPU tensors beside
    its own backend (`cuda:nccl,cpu:gloo`), which DCP's async save needs. A group that exists
    already (made by the caller) is used as it is.

    `timeout_seconds` bounds every collective until `set_collective_timeout` changes it.
    `trace_buf_size` sizes PyTorch's flight recorder (the last N collectives of every group,
    for `dump_flight_recorder`; 0 turns it off); None leaves torch's own setting (its
    `TORCH_FR_BUFFER_SIZE` variable) alone. With `trace_dir` (which the caller creates, once
    it knows the folder takes writes), NCCL's watchdog writes each rank's trace there when a
    collective times out (`rank_<n>` files). An explicit variable in the environment wins;
    `destroy_distributed` undoes what this set.
    """
    if trace_buf_size is not None and not dist.is_initialized():
        # Read by torch when each process group is created, so they must be set before; the
        # folder itself is the caller's to create (after it has checked that it may write there).
        _set_env_default("TORCH_FR_BUFFER_SIZE", str(trace_buf_size))
        if trace_dir is not None and trace_buf_size > 0:
            _set_env_default("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            _set_env_default("TORCH_FR_DUMP_TEMP_FILE", os.path.join(str(trace_dir), "rank_"))
    backend = process_group_backend(device_type)
    for name in dict.fromkeys(part.split(":")[-1] for part in backend.split(",")):
        if not dist.is_backend_available(name):
            raise RuntimeError(
                f"a process group on {device_type} needs the {name} backend ({backend}), and"
                f" this torch build ({torch.__version__}) has none\nuse a torch build with"
                f" {name}, or another --job.device"
            )
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and os.environ.get("MASTER_ADDR"):
        # Ranks on other hosts reach this one over the interface that reaches the rendezvous
        # host, not over the address this host's name resolves to (127.0.1.1 on Debian).
        point_gloo_at(os.environ["MASTER_ADDR"])
    device = local_device(device_type)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_seconds)
        if "MASTER_ADDR" in os.environ or world_size > 1:
            store, rank, world_size = _attempt_store(timeout)
            dist.init_process_group(
                backend=backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                device_id=_device_id(device),
            )
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device, backend)


def set_collective_timeout(seconds: float) -> int:
    """Make every existing process group (the default one, every mesh's) give up on a
    collective after `seconds`: a rank that stalls or dies then ends the job with an error
    instead of leaving the others waiting forever. Returns the number of groups changed."""
    if not dist.is_initialized():
        return 0
    timeout = timedelta(seconds=seconds)
    groups = list(dist.distributed_c10d._world.pg_map)
    set_timeout = getattr(dist, "set_timeout", None)
    if set_timeout is None:  # older torch (2.11): the same call under a private name
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is None:
            note_missing(
                "torch.distributed.set_timeout",
                "collectives keep the timeout the process groups were created with"
                " ([comm] init_timeout_seconds)",
                off=True,
            )
            return 0
        note_missing("torch.distributed.set_timeout", "using its older _set_pg_timeout")
    for group in groups:
        set_timeout(timeout, group)
    return len(groups)


def dump_flight_recorder(folder: str | os.PathLike, rank: int) -> str | None:
    """Write this rank's flight-recorder trace (its last collectives, see `init_distributed`'s
    `trace_buf_size`) to `<folder>/rank_<rank>`, the layout PyTorch's analyzer reads
    (`python -m torch.distributed.flight_recorder.fr_trace <folder>`). Returns the path, or
    None when there is nothing to write."""
    if not dist.is_initialized():
        return None
    backend = device_backend_name()
    try:
        trace = torch._C._distributed_c10d._dump_fr_trace(True, True, False, backend)
    except (AttributeError, RuntimeError, TypeError):
        return None
    if not trace:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank_{rank}")
    with open(path, "wb") as f:
        f.write(_with_group_config(trace))
    return path


def device_backend_name(group: dist.ProcessGroup | None = None) -> str:
    """The backend that carries the device's collectives in `group` (default: the default
    group): `nccl` for a `cuda:nccl,cpu:gloo` group, `gloo` for a CPU one."""
    spec = str(dist.get_backend(group))
    return spec.split(",")[0].split(":")[-1]


def _with_group_config(trace: bytes) -> bytes:
    """The trace with every process group it mentions described in its `pg_config` (name,
    description, global ranks), which the analyzer needs; gloo's recorder leaves it empty."""
    import pickle

    data = pickle.loads(trace)
    world = dist.distributed_c10d._world
    config = dict(data.get("pg_config") or {})
    for group, name in world.pg_names.items():
        config.setdefault(
            name,
            {
                "name": name,
                "desc": getattr(group, "group_desc", name),
                "ranks": str(sorted(world.pg_group_ranks.get(group, {}))),
            },
        )
    data["pg_config"] = {k: v for k, v in config.items() if k}
    return pickle.dumps(data)


def _device_id(device: torch.device) -> torch.device | None:
    # Binding the group to a device lets NCCL create communicators eagerly; gloo takes none.
    return device if device.type == "cuda" else None


# The variables init_distributed set (not the user), undone by destroy_distributed: a later
# job in this process, or a process it starts, must not inherit them as if they were the user's.
_ENV_SET: dict[str, str] = {}


def _attempt_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """torch's own env:// rendezvous (the torchrun agent's store), with keys under this
    attempt's prefix. torchrun keeps one store for all the attempts of a job: after a restart
    (`--max-restarts`) the process group's keys from the failed attempt are still there, and a
    rank that read its peer's old address would wait for it forever."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"titan/attempt_{attempt}", store), rank, world_size


def _set_env_default(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = _ENV_SET[name] = value


def destroy_distributed() -> None:
    """Destroy every process group and undo what `init_distributed` set."""
    if dist.is_initialized():
        # Unreachable objects that hold collective work (and its tensors) are freed here, while
        # the interpreter is whole: left to interpreter shutdown, gloo's threads could free them
        # after Python is gone and abort the process ("terminate called without an active
        # exception": 9 of 90 runs of the titan-parallel README's 2-process example, with or
        # without this module's store; none of 80 with these collections).
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    for name, value in list(_ENV_SET.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
        del _ENV_SET[name]


def world_size_from_env() -> int:
    """The job's process count as torchrun announces it (1 without torchrun), readable before
    any process group exists, so that configs can be checked first."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank of the default process group (`flag` itself without a
    group). A collective: every rank calls it. The tensor lives where the backend needs it (CPU
    for gloo, the accelerator for NCCL)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    backend = str(dist.get_backend())
    if "gloo" in backend:
        device = torch.device("cpu")
    else:
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
