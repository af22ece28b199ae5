"""One rank of one replica group of a fault-tolerant run (`run(argv, log, env)`, in a process of
its own), and the
model, data and single-process replay that tests/test_fault_tolerance.py checks it against.

Every group starts from the same seeded weights and trains on its own data (a function of the
group, the step index and the rank). Each rank writes one JSON line per attempted step to
`<out>/g<group>r<rank>i<incarnation>.jsonl` and, at the end, rank 0 the full parameters to
`<out>/g<group>i<incarnation>.pt`. A run ends after the first committed step at or past
`--steps` in which every group took part, so a group that was killed and restarted is back in
before the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from titan_parallel.fault_tolerance import FaultToleranceConfig, ReplicaGroup, SemiSync

SEED = 0
DIM, HIDDEN, OUT = 16, 32, 8
BATCH = 8  # per replica group; split over the group's ranks
LR = 1e-2
MAX_ATTEMPTS = 400  # a run that cannot finish in this many attempts is broken, not slow


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


_TEACHER = torch.randn(DIM, OUT, generator=torch.Generator().manual_seed(7))


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group `group`'s whole batch at step `step` (its ranks take equal slices)."""
    g = torch.Generator().manual_seed(1_000_003 * (group + 1) + step)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, torch.tanh(x @ _TEACHER) + 0.1 * torch.randn(BATCH, OUT, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replay(schedule: list[list[int]]) -> torch.Tensor:
    """The parameters one process gets by averaging, at step s, the gradients of exactly the
    groups in `schedule[s]` (each on its whole batch) and stepping the same optimizer."""
    model = build_model()
    opt = build_optimizer(model)
    for step, groups in enumerate(schedule):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for group in groups:
            model.zero_grad()
            loss_fn(model, *batch(group, step)).backward()
            for t, p in zip(total, model.parameters()):
                t += p.grad
        for t, p in zip(total, model.parameters()):
            p.grad = t / len(groups)
        opt.step()
    return flat_params(model)


class StepCounter:
    """Extra state that travels with the model when a group heals: attempts made so far (the
    training step, semi-synchronously)."""

    def __init__(self) -> None:
        self.attempts = 0

    def state_dict(self) -> dict:
        return {"attempts": self.attempts}

    def load_state_dict(self, state: dict) -> None:
        self.attempts = state["attempts"]


def run(argv: list[str], log: str, env: dict[str, str]) -> None:
    """A process's entry point: output to `log`, `env` added to the environment."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # torchft's own log goes to the stderr file descriptor
    os.environ.update(env)
    main(argv)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--min-replica-size", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL self in this step")
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--barrier", action="store_true", help="wait for every group's first rank")
    p.add_argument("--join-after", default="", help="FILE:STEP: join when FILE records STEP")
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--semi-sync", default="", help="local_sgd or diloco: see run_semi_sync")
    p.add_argument("--sync-steps", type=int, default=1)
    p.add_argument("--start-step", type=int, default=0, help="semi-sync: see run_semi_sync")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

    model = build_model()
    if args.fsdp:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = build_optimizer(model)
    counter = StepCounter()
    if args.join_after:
        path, step = args.join_after.rsplit(":", 1)
        while not any(r["step"] >= int(step) for r in _records(Path(path))):
            time.sleep(0.05)
    config = FaultToleranceConfig(
        enable=True,
        replica_id=args.group,
        group_size=args.groups,
        min_replica_size=args.min_replica_size,
        semi_sync_method=args.semi_sync,
        sync_steps=args.sync_steps,
        process_group_timeout_ms=5000,
        quorum_timeout_ms=60000,
        lighthouse=args.lighthouse,
    )
    store = {}
    if not args.fsdp:  # one rank per group: the group's store is its own
        from torch.distributed import TCPStore

        tcp = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store = {"rank": 0, "world_size": 1, "store_addr": "127.0.0.1", "store_port": tcp.port}
    group = ReplicaGroup(
        config,
        {"model": model, "optimizer": opt, "counter": counter},
        hostname="127.0.0.1",
        **store,
    )
    if args.barrier:
        (out / f"ready_g{args.group}r{rank}").touch()
        while len(list(out.glob("ready_*"))) < args.groups * world:
            time.sleep(0.05)
        time.sleep(0.3)
    if args.semi_sync:
        run_semi_sync(args, group, model, opt, counter, rank, world, out)
        return
    with open(out / f"g{args.group}r{rank}i{args.incarnation}.jsonl", "w") as records:
        while True:
            counter.attempts += 1
            if counter.attempts > MAX_ATTEMPTS:
                sys.exit(f"group {args.group}: no end after {MAX_ATTEMPTS} attempts")
            group.start_step()
            step = group.current_step()
            if step == args.kill_at:
                group.manager.wait_quorum()  # the others now expect this group in the all-reduce
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(args.group, step)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            group.average_gradients(model.parameters())
            committed = group.should_commit()
            if committed:
                opt.step()
            # The step this attempt was: a healing group learns it from the quorum.
            step = group.current_step() - 1 if committed else group.current_step()
            full = group.participants() == args.groups
            record = {
                "step": step,
                "committed": committed,
                "participating": group.is_participating(),
                "participants": group.participants(),
                "recovered": bool(group.recoveries) and group.recoveries[-1] == step,
                "attempts": counter.attempts,
                "time": time.time(),
            }
            records.write(json.dumps(record) + "\n")
            records.flush()
            if committed and full and group.current_step() >= args.steps:
                break
            if not full:
                time.sleep(0.2)  # short-handed: give a restarted group time to come back
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    if rank == 0:
        torch.save(
            {
                "params": torch.cat([q.detach().reshape(-1) for q in params]),
                "state": group.state_dict(),
            },
            out / f"g{args.group}i{args.incarnation}.pt",
        )
    group.close()
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads need no orderly teardown


def run_semi_sync(args, group, model, opt, counter, rank: int, world: int, out: Path) -> None:
    """Local steps on the group's own data up to `--steps`, synchronised (`SemiSync`) every
    `--sync-steps`; the step counter travels with the group's state, so a group that heals at a
    synchronisation goes on from the step it received. The final parameters of rank 0, and
    per synchronisation its steps before and after, whether it was applied, its group count,
    whether this group healed and the weights after it, to `<out>/g<group>i0.pt`.

    `--start-step N` starts at step N + 1 with the initial weights, as a group does after its
    synchronisation at step N failed (DiLoCo goes back to the last synchronised weights, here
    the initial ones, and the training step goes on)."""
    sync = SemiSync(group, model.parameters())
    counter.attempts = args.start_step
    synced = []
    while counter.attempts < args.steps:
        counter.attempts += 1
        step = counter.attempts
        x, y = batch(args.group, step - 1)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if sync.due(step):
            healed = len(group.recoveries)
            ok = sync.sync(step)
            weights = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            healed = len(group.recoveries) > healed
            synced.append((step, counter.attempts, ok, group.participants(), healed, weights))
    if rank == 0:
        params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        torch.save({"params": params, "synced": synced}, out / f"g{args.group}i0.pt")
    group.close()
    sys.stdout.flush()
    os._exit(0)


def replay_semi_sync(method: str, groups: int, steps: int, sync_steps: int) -> list[torch.Tensor]:
    """What `run_semi_sync` computes, in one process: every group's model stepped alone, and
    every `sync_steps` steps the average of their weights (local_sgd) or an outer Nesterov SGD
    step on the average of (last synced - now) (diloco, with the config's defaults)."""
    config = FaultToleranceConfig()
    models = [build_model() for _ in range(groups)]
    opts = [build_optimizer(m) for m in models]
    glob = build_model()  # diloco: the last synced weights, stepped by the outer optimizer
    outer = torch.optim.SGD(
        glob.parameters(), lr=config.outer_lr, momentum=config.outer_momentum, nesterov=True
    )
    for step in range(1, steps + 1):
        for g, (model, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            loss_fn(model, *batch(g, step - 1)).backward()
            opt.step()
        if step % sync_steps:
            continue
        with torch.no_grad():
            for i, p in enumerate(glob.parameters()):
                local = [list(m.parameters())[i] for m in models]
                if method == "local_sgd":
                    p.copy_(sum(local) / groups)
                else:
                    p.grad = sum(p - q for q in local) / groups
            if method == "diloco":
                outer.step()
            for m in models:
                for q, p in zip(m.parameters(), glob.parameters()):
                    q.copy_(p)
    return [flat_params(m) for m in models]


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


if __name__ == "__main__":
    main(sys.argv[1:])
