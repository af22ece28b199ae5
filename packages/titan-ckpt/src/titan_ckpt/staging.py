"""Copying the state to CPU memory for an async save, off the training loop's critical path.

DCP's DefaultStager copies on the calling thread unless CUDA is there to do it asynchronously.
`BackgroundStager` runs the same copy (into CPU buffers that are reused from save to save) on a
thread of its own, so that `save()` returns at once; the manager makes the optimizer wait for
the copy before its next step, because parameters and optimizer states change only there.
Buffers, which a forward pass may change, are cloned before the save returns (see ModelState).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

# Pinned memory and non-blocking copies only exist with an accelerator to copy from.
PINNED = StagingOptions(
    use_pinned_memory=True,
    use_shared_memory=False,
    use_async_staging=True,
    use_non_blocking_copy=True,
)
PLAIN = StagingOptions(
    use_pinned_memory=False,
    use_shared_memory=False,
    use_async_staging=False,
    use_non_blocking_copy=False,
)


def build_stager(mode: str, background: bool) -> AsyncStager:
    """The stager for an async mode: pinned + non-blocking on CUDA, plain CPU memory otherwise."""
    if mode == "async_with_pinned_mem":
        return DefaultStager(PINNED)
    return BackgroundStager() if background else DefaultStager(PLAIN)


class BackgroundStager(AsyncStager):
    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._copier = DefaultStager(PLAIN)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-ckpt-stage")

    def stage(self, state_dict: dict[str, Any]) -> Future:
        return self._thread.submit(self._copier.stage, state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._copier.close()
