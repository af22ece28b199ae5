"""Checkpoint benchmark: sync save time, async blocking time and load time for a model of a few
hundred MB (a stack of fp32 linears trained with AdamW: the checkpoint holds weights and two
moments, 3x the model), and what the integrity checks cost: a save with checksums against
DCP's plain save of the same state, and a read with checksums (and a manager's whole verified
load) against DCP's plain read, printed as JSON lines. Ratios with a target say whether they
met it (`met`).

    uv run --no-sync python bench/ckpt.py [--mb 200] [--saves 3] [--interval 5] [--dir /tmp]
    uv run --no-sync python bench/ckpt.py --only checksums --mb 64,200,683 --saves 7

The training loop is real (forward, backward, step) so that an async save's background copy and
write overlap with compute as they would in a run. Blocking time of an async save = the save()
call + the wait before the next optimizer step for the copy to finish. Compare ratios measured
side by side in one run; absolute times depend on the disk and memory of the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mb",
        default="200",
        help="model size in MB, or several separated by commas (each measured in turn); the"
        " checkpoint is 3x with AdamW",
    )
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--interval", type=int, default=5, help="steps between saves (long enough for a write)"
    )
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument(
        "--only", choices=["checksums"], default=None, help="run only the checksum comparison"
    )
    return parser.parse_args(argv)


# The flags are read before the imports below load torch (seconds): `--help` and a bad flag
# answer at once.
if __name__ == "__main__":
    ARGS = parse_args()

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from titan_ckpt import Checkpoint, CheckpointManager, checkpoint_problems
from titan_ckpt.dcp_io import checksums_to_check_while_reading
from titan_ckpt.integrity import ChecksummingWriter, nonfinite_entries
from titan_ckpt.safe_read import SafeFileSystemReader


class Step:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(megabytes: int, width: int = 2048):
    layers = max(1, round(megabytes * 2**20 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    return model, optimizer


def train(
    folder: str, megabytes: int, async_mode: str | None, saves: int, batch: int, interval: int
) -> list[dict]:
    """Train `saves` x `interval` + 1 steps, saving every `interval` steps (none if `async_mode`
    is None); per step: seconds of the step, of the save() call and of the staging wait."""
    model, optimizer = build(megabytes)
    state = Step()
    manager = None
    if async_mode is not None:
        cfg = Checkpoint(enable=True, interval=interval, keep_latest_k=1, async_mode=async_mode)
        manager = CheckpointManager(
            cfg, {"model": model, "optimizer": optimizer, "train_state": state}, folder
        )
    x = torch.randn(batch, model[0].in_features, device=DEVICE)
    rows = []
    for _ in range(saves * interval + 1):
        state.step += 1
        start = time.perf_counter()
        model(x).square().mean().backward()
        wait_start = time.perf_counter()
        if manager is not None:
            manager.wait_for_staging()  # what the optimizer's pre-step hook would wait
        wait = time.perf_counter() - wait_start
        optimizer.step()
        optimizer.zero_grad()
        save_start = time.perf_counter()
        if manager is not None:
            manager.save(state.step)
        save = time.perf_counter() - save_start
        rows.append(
            {
                "step": state.step,
                "step_s": time.perf_counter() - start,
                "save_s": save,
                "wait_s": wait,
            }
        )
    if manager is not None:
        manager.close()
    return rows


def _time_saves(folder: str, megabytes: int, repeats: int, run: Path, timed) -> None:
    """The save side of `checksum_cost`; the manager's last save stays in `run`."""
    model, optimizer = build(megabytes)
    model(torch.randn(4, model[0].in_features, device=DEVICE)).square().mean().backward()
    optimizer.step()  # the moments exist: the checkpoint is 3x the model
    states = {"model": model, "optimizer": optimizer, "train_state": Step()}
    wrapped = dict(CheckpointManager(Checkpoint(), states, Path(folder) / "unused").states)
    wrapped.pop("rng")
    manager = CheckpointManager(Checkpoint(enable=True, interval=1, keep_latest_k=1), states, run)

    def save_with(writer):
        out = Path(folder) / f"save-{writer.__name__}"
        shutil.rmtree(out, ignore_errors=True)
        return lambda: dcp.save(wrapped, storage_writer=writer(str(out)), no_dist=True)

    for i in range(repeats):
        variants = [
            ("checksummed_save_s", save_with(ChecksummingWriter)),
            ("plain_dcp_save_s", save_with(dcp.FileSystemWriter)),
            ("manager_save_s", lambda i=i: manager.save(i + 1)),
        ]
        for name, fn in variants[i % 3 :] + variants[: i % 3]:
            timed(name, fn)
        timed(
            "nonfinite_check_s",
            lambda: (
                nonfinite_entries(wrapped["model"].state_dict()),
                nonfinite_entries(wrapped["optimizer"].state_dict()),
            ),
        )
    manager.close()


def checksum_cost(folder: str, megabytes: int, repeats: int) -> list[dict]:
    """What the integrity checks cost, as medians of `repeats` rounds whose variants alternate
    in order (a busy machine slows them alike):
    - save: DCP's save of the full state through titan-ckpt's checksumming writer against DCP's
      plain FileSystemWriter, into fresh folders; and a manager's whole save (NaN/inf check,
      checksummed write, commit) against the same plain save;
    - load: DCP's read with the checksums checked as it reads against DCP's plain read, and a
      manager's whole load (marker, metadata and sizes checked, checksummed read, NaN/inf check)
      against the plain read, each into freshly built objects;
    - the NaN/inf check a save runs, and an offline verification of every byte."""
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        start = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - start)

    run = Path(folder) / "run"
    _time_saves(folder, megabytes, repeats, run, timed)
    step_dir = run / f"step-{repeats}"
    sums = checksums_to_check_while_reading(step_dir)

    def fresh_request():
        fresh, opt = build(megabytes)
        request = dict(
            CheckpointManager(
                Checkpoint(), {"model": fresh, "optimizer": opt}, Path(folder) / "unused"
            ).states
        )
        request.pop("rng")
        return request

    def read(reader_factory):
        request = fresh_request()
        return lambda: dcp.load(request, storage_reader=reader_factory(), no_dist=True)

    def manager_load():
        fresh, opt = build(megabytes)
        reader = CheckpointManager(
            Checkpoint(), {"model": fresh, "optimizer": opt, "train_state": Step()}, run
        )
        return lambda: reader.load()

    for i in range(repeats):
        variants = [
            ("plain_dcp_load_s", lambda: read(lambda: dcp.FileSystemReader(str(step_dir)))),
            (
                "checksummed_read_s",
                lambda: read(lambda: SafeFileSystemReader(str(step_dir), checksums=sums)),
            ),
            ("verified_load_s", manager_load),
        ]
        for name, prepare in variants[i % 3 :] + variants[: i % 3]:
            timed(name, prepare())  # the objects are built outside the timing
        timed("verify_only_s", lambda: checkpoint_problems(step_dir))
    assert not checkpoint_problems(step_dir)
    size = sum(p.stat().st_size for p in step_dir.iterdir())
    med = {name: statistics.median(values) for name, values in times.items()}
    best = {name: min(values) for name, values in times.items()}

    def ratio(metric: str, a: str, b: str, target: float | None = None) -> dict:
        # The median of the rounds' own ratios (a round runs both back to back, so a load that
        # others put on the machine for a while slows both alike), the ratio of the medians,
        # and that of the best times (the ones least slowed by others).
        paired = statistics.median(x / y for x, y in zip(times[a], times[b]))
        row = {
            "metric": metric,
            "value": round(paired, 3),
            "of_medians": round(med[a] / med[b], 3),
            "of_best": round(best[a] / best[b], 3),
        }
        if target is not None:
            row.update(target=target, met=paired <= target)
        return row

    rows = [
        {"metric": name, "value": round(value, 4), "best": round(best[name], 4)}
        for name, value in med.items()
    ]
    return [
        *rows,
        ratio("checksummed_save_over_plain_save", "checksummed_save_s", "plain_dcp_save_s", 1.1),
        ratio("checksummed_read_over_plain_read", "checksummed_read_s", "plain_dcp_load_s", 1.2),
        ratio("manager_save_over_plain_save", "manager_save_s", "plain_dcp_save_s"),
        ratio("verified_load_over_plain_load", "verified_load_s", "plain_dcp_load_s", 1.2),
        ratio("nonfinite_check_over_plain_save", "nonfinite_check_s", "plain_dcp_save_s"),
        {"metric": "verify_gb_per_s", "value": round(size / med["verify_only_s"] / 1e9, 3)},
        {"metric": "checkpoint_bytes", "value": size},
    ]


def async_rows(mode: str, asyn: list[dict], interval: int, sync_s: float, step_s: float):
    """What an async save costs the training loop, against a synchronous save."""

    def saved(i: int) -> bool:  # steps interval, 2 x interval, ... save
        return asyn[i]["step"] % interval == 0 and i + 1 < len(asyn)

    calls = [asyn[i]["save_s"] for i in range(len(asyn)) if saved(i)]
    waits = [asyn[i + 1]["wait_s"] for i in range(len(asyn)) if saved(i)]
    block_s = statistics.median(c + w for c, w in zip(calls, waits))
    pair_s = statistics.median(
        asyn[i]["step_s"] + asyn[i + 1]["step_s"] for i in range(len(asyn)) if saved(i)
    )
    rows = [
        {"metric": "async_blocking_s", "value": round(block_s, 4)},
        {"metric": "async_save_call_s", "value": round(statistics.median(calls), 4)},
        {"metric": "async_staging_wait_s", "value": round(statistics.median(waits), 4)},
        {
            "metric": "async_blocking_over_sync_save",
            "value": round(block_s / sync_s, 4),
            "target": 0.10,
        },
        # The saving step and the next one against two plain steps: on a CPU the background copy
        # and write share the cores with training, so some cost shows up as slower compute.
        {"metric": "async_two_step_overhead_s", "value": round(pair_s - 2 * step_s, 4)},
    ]
    return [{**row, "async_mode": mode} for row in rows]


def main(args: argparse.Namespace) -> None:
    for megabytes in (int(mb) for mb in args.mb.split(",")):
        measure(megabytes, args)


def measure(megabytes: int, args: argparse.Namespace) -> None:
    model, _ = build(megabytes)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    common = {
        "bench": "ckpt",
        "model_mb": round(size / 2**20, 1),
        "checkpoint_mb": round(3 * size / 2**20, 1),
        "device": str(DEVICE),
        "saves": args.saves,
        "interval": args.interval,
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for row in checksum_cost(folder, megabytes, args.saves):
            print(json.dumps({**common, **row}), flush=True)
    if args.only == "checksums":
        return
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as sync_dir,
        tempfile.TemporaryDirectory(dir=args.dir) as async_dir,
    ):
        plain = train(sync_dir, megabytes, None, args.saves, args.batch, args.interval)
        sync = train(sync_dir, megabytes, "disabled", args.saves, args.batch, args.interval)
        # Pinned host buffers need CUDA: the staging copy then runs without blocking the GPU.
        modes = ["async"] + (["async_with_pinned_mem"] if DEVICE.type == "cuda" else [])
        runs = {
            m: train(async_dir, megabytes, m, args.saves, args.batch, args.interval) for m in modes
        }
        loads = []
        for _ in range(args.saves):
            fresh, opt = build(megabytes)
            manager = CheckpointManager(
                Checkpoint(enable=True),
                {"model": fresh, "optimizer": opt, "train_state": Step()},
                sync_dir,
            )
            start = time.perf_counter()
            manager.load()
            loads.append(time.perf_counter() - start)

    sync_s = statistics.median(r["save_s"] for r in sync if r["step"] % args.interval == 0)
    step_s = statistics.median(r["step_s"] for r in plain[1:])
    rows = [
        {"metric": "train_step_s", "value": round(step_s, 4)},
        {"metric": "sync_save_s", "value": round(sync_s, 4)},
    ]
    for mode, asyn in runs.items():
        rows += async_rows(mode, asyn, args.interval, sync_s, step_s)
    rows += [
        {"metric": "load_s", "value": round(statistics.median(loads), 4)},
        {"metric": "save_gb_per_s", "value": round(3 * size / sync_s / 1e9, 3)},
    ]
    for row in rows:
        print(json.dumps({**common, **row}))


if __name__ == "__main__":
    main(ARGS)
