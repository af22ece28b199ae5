"""Worker processes for one rank's loader, through `torch.utils.data.DataLoader`.

Worker `w` of `W` makes the positions `p` of every microbatch with `p mod W == w`, and yields one
item per microbatch: its windows and the states of the packing streams it moved. DataLoader
returns workers' items in turn (worker 0, 1, ..., W-1, 0, ...), so the loader reads exactly one
item per worker per microbatch and interleaves their rows back into place.

Why not torchdata's `StatefulDataLoader`: it works with this torch (0.11 with 2.15), but it
checkpoints each worker's dataset state under its worker index and refuses a state saved with
another worker count, and the state would be this rank's. Here every item carries the state of
the streams it came from, so the loader's state is a position in the global order: it resumes
on any worker count and any data-parallel layout, and the plain DataLoader only has to run the
processes (start, prefetch, notice a dead worker).

A worker never raises a data error through DataLoader (its message would come wrapped in a
worker traceback): it yields `{"error": message}` and stops, and the loader raises `DataError`
with that message. A worker that dies (killed, out of memory) is reported by DataLoader within
seconds and becomes a `DataError` too, never a hang.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from titan_core.messages import first_line
from titan_data.batches import Plan, Position, produce
from titan_data.errors import DataError


class WorkerStream(IterableDataset):
    """What each worker process iterates (see the module docstring)."""

    def __init__(
        self, plan: Plan, start: Position, streams: dict[str, dict[str, Any]], workers: int
    ):
        self.plan, self.start, self.streams, self.workers = plan, start, streams, workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        positions = range(worker, self.plan.layout.batch_size, self.workers)
        try:
            for item in produce(self.plan, self.start, self.streams, positions):
                for state in item["streams"].values():
                    # One array instead of a list of ints: pickled as bytes, not int by int.
                    state["buffer"] = np.asarray(state["buffer"], dtype=np.int64)
                yield item
        except DataError as e:
            yield {"error": str(e)}
            return
        yield {"end": True}


def _keep(item: Any) -> Any:
    return item  # items stay numpy: no per-element conversion, no pinning of the states


def _init_worker(_worker_id: int) -> None:
    # The trainer's SIGTERM handler (save and stop) belongs to the training process; a worker
    # simply ends with it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    if "fsspec" in sys.modules:  # fsspec's event loop must not be shared with the parent
        import fsspec.asyn

        fsspec.asyn.reset_lock()


def worker_count(requested: int, batch_size: int) -> int:
    """Workers that have positions to make: at most one per sample of a microbatch."""
    return max(0, min(requested, batch_size))


def start_workers(
    plan: Plan,
    start: Position,
    streams: dict[str, dict[str, Any]],
    workers: int,
    prefetch_factor: int,
) -> Iterator[list[dict[str, Any]]]:
    """Per microbatch, the list of the `workers` items that make it, in worker order."""
    loader = DataLoader(
        WorkerStream(plan, start, streams, workers),
        batch_size=None,
        num_workers=workers,
        collate_fn=_keep,
        prefetch_factor=prefetch_factor,
        worker_init_fn=_init_worker,
    )
    items = iter(loader)
    try:
        while True:
            group = []
            for _ in range(workers):
                try:
                    item = next(items)
                except StopIteration:
                    return
                except RuntimeError as e:  # DataLoader reports a worker that died this way
                    raise DataError(
                        f"a data loader worker of dp rank {plan.layout.dp_rank} stopped:"
                        f" {first_line(e)}"
                        "\nthe run cannot go on without its batches; resume from the last"
                        " checkpoint"
                    ) from e
                if "error" in item:
                    raise DataError(item["error"])
                if "end" in item:
                    return
                group.append(item)
            yield group
    finally:
        # Stops the workers now, even while a traceback still holds this frame.
        items._shutdown_workers()
