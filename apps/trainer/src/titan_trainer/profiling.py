"""torch.profiler traces and CUDA memory snapshots, every `profile_freq` steps."""

from __future__ import annotations

import contextlib
import os
import pickle

import torch

from titan_core import get_logger

log = get_logger("profiling")


@contextlib.contextmanager
def maybe_profile(cfg, dump_folder: str, rank: int, start_step: int):
    """Yield a callable to invoke once per step (or None when profiling is off).

    Records one active step in every `profile_freq` (after a wait and a warm-up step) and
    writes a Chrome trace per rank into `dump_folder/save_traces_folder/iteration_N/`.
    """
    if not cfg.enable_profiling:
        yield None
        return
    folder = os.path.join(dump_folder, cfg.save_traces_folder)
    step = {"n": start_step}

    def on_ready(prof) -> None:
        out = os.path.join(folder, f"iteration_{step['n']}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json"))
        log.info("profiler trace written to %s", out)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait = max(cfg.profile_freq - 2, 0)
    schedule = torch.profiler.schedule(wait=wait, warmup=1 if cfg.profile_freq > 1 else 0, active=1)
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=on_ready
    ) as prof:

        def advance() -> None:
            step["n"] += 1
            prof.step()

        yield advance


@contextlib.contextmanager
def maybe_memory_snapshot(cfg, dump_folder: str, rank: int):
    """Record CUDA allocator history; dump a snapshot at exit (and on an out-of-memory error)."""
    if not (cfg.enable_memory_snapshot and torch.cuda.is_available()):
        if cfg.enable_memory_snapshot:
            log.warning("profiling.enable_memory_snapshot needs CUDA; no snapshot on this device")
        yield
        return
    folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
    os.makedirs(folder, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        with open(os.path.join(folder, f"rank{rank}_memory_snapshot.pickle"), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
