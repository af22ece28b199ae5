"""Fault-tolerant data parallelism across replica groups with TorchFT (`pip install
'titan-llm-parallel[ft]'`).

A job is split into replica groups: each group is an ordinary job of its own (FSDP, TP, ... inside
it) with its own torchrun and its own TCP store, and the groups train the same model on different
data. Across groups, gradients are averaged through a `torchft.Manager`, which asks a lighthouse
(one small server for the whole job) for a quorum every step. When a group dies, the step it was
part of fails on every group (`should_commit()` is False, nobody steps the optimizer) and is
retried with the groups that are left; the survivors never restart. A restarted group joins the
next quorum, receives the current weights, optimizer state and step from a live group
(`healing`), and takes part from the step after.

Rank i of every group is paired with rank i of the others (torchft builds one process group per
group rank), so under FSDP each rank averages its own shard: a DTensor gradient is averaged by its
local tensor, in place.

torchft.DistributedDataParallel is not used: in torchft 0.2 its communication hook fails an
assertion on the surviving groups when a peer dies during the all-reduce. Gradients go through
`Manager.allreduce` instead, one flat buffer per dtype, whose errors fail the step cleanly.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
import torch.distributed
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core import ConfigError, point_gloo_at
from titan_parallel.config import FaultToleranceConfig

logger = logging.getLogger(__name__)

_INSTALL = "pip install 'titan-llm-parallel[ft]'"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


def _torchft() -> Any:
    # torchft's Rust side logs every quorum and vote at INFO: a few lines per step. Warnings
    # only, unless the user asks for more (RUST_LOG=info).
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        import torchft.coordination
    except ImportError as e:
        raise ImportError(
            f"fault tolerance needs torchft, which is not installed ({e}); install it with"
            f" {_INSTALL}"
        ) from e
    return torchft


def start_lighthouse(
    bind: str = "[::]:0",
    min_replicas: int = 1,
    *,
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Any:
    """A lighthouse in this process (tests, one machine); its `address()` is what the replica
    groups need. A real job runs `torchft_lighthouse --bind [::]:29510 --min_replicas 1`
    on one host instead. `min_replicas` groups must be up before the first quorum forms;
    `join_timeout_ms` is how long a quorum waits for more groups than that."""
    coordination = _torchft().coordination
    return coordination.LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


class ReplicaGroup:
    """This process's place in a fault-tolerant job: a `torchft.Manager` for its replica group.

    `state` holds what a restarted group must receive from a live one to continue exactly where
    the others are: the model and optimizer, plus whatever else the caller passes (a learning-rate
    scheduler, a data loader, a step counter: anything with `state_dict`/`load_state_dict`).
    Every rank of a group creates one, with the group's rank, world size and TCP store (torchrun's
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT unless given; a process started without
    torchrun is a group of one with a store of its own).

    A step::

        group.start_step()                 # asks for the quorum, in the background
        loss_fn(model(x), y).backward()
        group.average_gradients(model.parameters())
        if group.should_commit():          # every group agrees; False: skip this step, retry
            optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(
        self,
        config: FaultToleranceConfig,
        state: Mapping[str, Stateful],
        *,
        device: torch.device | str = "cpu",
        rank: int | None = None,
        world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        hostname: str | None = None,
    ):
        if problems := config.validate():
            raise ConfigError("\n".join(problems))
        if not config.enable:
            raise ConfigError(
                "ReplicaGroup needs [fault_tolerance] enable = true; without it, train without"
                " a ReplicaGroup"
            )
        if not state:
            raise ValueError(
                "ReplicaGroup needs the state a restarted group receives from a live one, e.g."
                " state={'model': model, 'optimizer': optimizer}"
            )
        torchft = _torchft()
        self.config = config
        self._state = dict(state)
        self.recoveries: list[int] = []
        """The steps at which this group received its state from a live group."""
        timeout = timedelta(milliseconds=config.process_group_timeout_ms)
        lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ConfigError(
                "no lighthouse: set [fault_tolerance] lighthouse or TORCHFT_LIGHTHOUSE to the"
                " address of a running `torchft_lighthouse` (http://host:port)"
            )
        if torch.device(device).type == "cuda":
            pg = torchft.ProcessGroupNCCL(timeout=timeout)
        else:
            # The groups meet over gloo across hosts: on the interface that reaches the
            # lighthouse, not the one the host's name resolves to (127.0.1.1 on Debian).
            interface = point_gloo_at(urlsplit(lighthouse).hostname or "")
            if interface:
                logger.info("replica groups meet over %s (GLOO_SOCKET_IFNAME), the interface"
                         " that reaches the lighthouse", interface)  # fmt: skip
            pg = torchft.ProcessGroupGloo(timeout=timeout)
        self._store = None
        if store_addr is None and "MASTER_ADDR" not in os.environ:
            # A group of one process, not started by torchrun: it keeps its own store.
            self._store = torch.distributed.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False
            )
            store_addr, store_port, rank, world_size = "127.0.0.1", self._store.port, 0, 1
        # torchft reads the state a healing group needs on its quorum thread, which with an
        # asynchronous quorum overlaps this step's forward and backward. FSDP2 swaps a module's
        # parameters for unsharded ones during both, so a read then races with the step (and
        # can free storage the backward still needs): reads wait until the gradients are done.
        self._outside_compute = threading.Event()
        self._outside_compute.set()
        # One key per stateful object: torchft hands each its own part of the received state.
        first, *rest = self._state
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=self._loader(first),
            state_dict=self._reader(first),
            min_replica_size=config.min_replica_size,
            # Replica groups start from the same seeded weights: no copy at step 0.
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(milliseconds=config.quorum_timeout_ms),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"titan_ft_{config.replica_id}",
            **({"hostname": hostname} if hostname else {}),
        )
        for key in rest:
            self.manager.register_state_dict_fn(key, self._loader(key), self._reader(key))

    def _loader(self, key: str):
        def load(state_dict: dict[str, Any]) -> None:
            self._state[key].load_state_dict(state_dict)
            if key == next(iter(self._state)):
                step = self.manager.current_step()
                self.recoveries.append(step)
                logger.warning(
                    "replica group %d recovered step %d from a live replica group",
                    self.config.replica_id,
                    step,
                )

        return load

    def _reader(self, key: str):
        def read() -> dict[str, Any]:
            self._outside_compute.wait()
            return self._state[key].state_dict()

        return read

    def add_state(self, key: str, obj: Stateful) -> None:
        """One more object a healing group receives from a live one, under `key`."""
        if key in self._state:
            raise ValueError(f"the replica group's state already has {key!r}")
        self._state[key] = obj
        self.manager.register_state_dict_fn(key, self._loader(key), self._reader(key))

    def start_step(self) -> None:
        """Start this step's quorum (asynchronously: it overlaps the forward pass)."""
        self._outside_compute.clear()
        self.manager.start_quorum()

    def average_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Average the gradients of `params` over the replica groups of this step's quorum, in
        place: one flat buffer per dtype and device. A DTensor gradient is averaged by its local
        shard, which rank i of every group holds alike. A group that is healing contributes
        zeros and is not counted. A failure (a peer died) is recorded and fails `should_commit`."""
        self._outside_compute.set()
        self._average([_local(p.grad) for p in params if p.grad is not None])

    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` (local ones) over this step's quorum, in place, one flat buffer per
        dtype and device."""
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for g in tensors:
            buckets[(g.dtype, g.device)].append(g)
        pending = []
        for tensors in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            pending.append((flat, tensors, self.manager.allreduce(flat)))
        for flat, tensors, work in pending:
            work.wait()
            for t, averaged in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(averaged.view_as(t))

    def should_commit(self) -> bool:
        """Whether every replica group of this step completed it: step the optimizer only then.
        A restarted group loads the state it received here, before its first step."""
        self._outside_compute.set()
        return self.manager.should_commit()

    def participants(self) -> int:
        """Number of replica groups whose gradients this step averages."""
        return self.manager.num_participants()

    def is_participating(self) -> bool:
        """False while this group is healing (its gradients are not counted this step)."""
        return self.manager.is_participating()

    def current_step(self) -> int:
        """Committed steps so far (the same on every group of the quorum)."""
        return self.manager.current_step()

    def batches_committed(self) -> int:
        """Per-group batches committed so far, summed over groups (a step of 3 groups is 3)."""
        return self.manager.batches_committed()

    def state_dict(self) -> dict[str, int]:
        """The manager's step and batch count: save it with each checkpoint."""
        return self.manager.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.manager.load_state_dict(state_dict)

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SemiSync:
    """LocalSGD or DiLoCo across the replica groups of `group` ([fault_tolerance]
    semi_sync_method): each group steps its own optimizer on its own data, and every
    `sync_steps` steps (`due(step)`) `sync()` brings the groups together:

    - `local_sgd`: the weights become the average of the groups' weights.
    - `diloco`: the average change of the weights since the last synchronisation (the
      pseudo-gradient, taken as `last synced - now`) is applied to the last synced weights by an
      outer SGD with Nesterov momentum (`outer_lr`, `outer_momentum`).

    A synchronisation that a failure interrupts is not applied anywhere: with local_sgd each group
    keeps its own weights and tries again at the next due step; with diloco every group goes back
    to the last synced weights (the local steps since are lost, as in DiLoCo). A group that heals
    at a synchronisation (restarted, or behind the others' step) receives the weights, optimizer
    states and this object's state (the last synced weights and the outer momentum) from a live
    group, and ends it like the others.

    torchft's own `LocalSGD` and `DiLoCo` hook the optimizer and count steps themselves; here the
    caller's step decides (so that a resumed or healed group synchronises at the same steps as
    the others), the state is checkpointable like any other (`state_dict`), and a DTensor
    parameter is averaged by its local shard, like gradients in `average_gradients`.
    """

    def __init__(self, group: ReplicaGroup, params: Iterable[nn.Parameter]):
        config = group.config
        if config.semi_sync_method not in ("local_sgd", "diloco"):
            raise ConfigError(
                f"SemiSync needs [fault_tolerance] semi_sync_method = local_sgd or diloco, not"
                f" {config.semi_sync_method!r}"
            )
        self.group = group
        self.method = config.semi_sync_method
        self.sync_steps = config.sync_steps
        self.params = [p for p in params if p.requires_grad]
        self.synced: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None
        self.loaded = False
        """Whether `load_state_dict` gave this object its state (a checkpoint, or a live group)."""
        if self.method == "diloco":
            self.synced = [_local(p).detach().clone() for p in self.params]
            self.outer = torch.optim.SGD(
                self.params, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True
            )
            # A zero buffer steps exactly like torch's first-step copy of the gradient, and makes
            # the momentum part of every state_dict (a checkpoint loads only keys it is given).
            for p in self.params:
                self.outer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            group.add_state("semi_sync", self)  # a healing group receives it too

    def snapshot(self) -> None:
        """Take the current weights as the last synchronised ones (DiLoCo). Done when this
        object is built; call it again after the weights change other than by training (set
        after a meta-device build, or loaded from a checkpoint without this object's state)."""
        for s, p in zip(self.synced, self.params):
            s.copy_(_local(p).detach())

    def due(self, step: int) -> bool:
        """Whether step `step` (counted from 1) ends with a synchronisation."""
        return step % self.sync_steps == 0

    @torch.no_grad()
    def sync(self, step: int) -> bool:
        """Synchronise now, after the optimizer step of `step` (a due step), on every rank of
        every group. Returns whether the synchronisation was applied.

        A group whose step is behind the others' receives their state here (weights, optimizer,
        this object's state, and whatever else the group's state holds: keep the step counter
        there, so that the caller continues from the received step) and ends the
        synchronisation like them."""
        group = self.group
        # torchft heals a group whose step count is below the others'. Its own count is of
        # applied synchronisations, which does not tell a lagging group apart: after a failed
        # one (applied nowhere, every group keeps its training step) a group restarted from the
        # checkpoint of the last applied one has the others' count and a training step
        # sync_steps behind theirs, and would join them without healing, behind to the end.
        # Counted from the training step instead, it heals.
        group.load_state_dict(
            {"step": step // self.sync_steps - 1, "batches_committed": group.batches_committed()}
        )
        group.manager.start_quorum()  # no forward or backward runs: state reads may go on
        locals_ = [_local(p) for p in self.params]
        if self.method == "local_sgd":
            values = [t.detach().clone() for t in locals_]
        else:
            values = [s - t for s, t in zip(self.synced, locals_)]  # the pseudo-gradient
        group._average(values)
        # A healing group loads the live group's weights, states and `synced` in here.
        committed = group.should_commit()
        if self.method == "local_sgd":
            if committed:
                for t, v in zip(locals_, values):
                    t.copy_(v)
            return committed
        for t, s in zip(locals_, self.synced):  # back to the last synced weights
            t.copy_(s)
        if committed:
            for p, v in zip(self.params, values):
                p.grad = _like(p, v)
            self.outer.step()
            for p in self.params:
                p.grad = None
            for s, t in zip(self.synced, locals_):
                s.copy_(t)
        return committed

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's last synced weights and outer momentum, shaped like the parameters (DTensors
        where they are), so that a checkpointer saves and reshards them; empty for local_sgd."""
        if self.method != "diloco":
            return {}
        state: dict[str, Any] = {}
        for i, (p, s) in enumerate(zip(self.params, self.synced)):
            state[f"synced.{i}"] = _like(p, s)
            state[f"momentum.{i}"] = self.outer.state[p]["momentum_buffer"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = True
        if self.method != "diloco":
            return
        for i, (p, s) in enumerate(zip(self.params, self.synced)):
            s.copy_(_local(state[f"synced.{i}"]))
            self.outer.state[p]["momentum_buffer"].copy_(state[f"momentum.{i}"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor of `param`'s kind: a DTensor with its mesh and placements, or itself."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
