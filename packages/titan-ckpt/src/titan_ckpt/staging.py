"""Copying the state to CPU memory for an async save, off the training loop's critical path.

DCP's DefaultStager copies on the calling thread unless CUDA is there to do it asynchronously.
`BackgroundStager` runs the same copy (into CPU buffers that are reused from save to save) on a
thread of its own, so that `save()` returns at once; the manager makes the optimizer wait for
the copy before its next step, because parameters and optimizer states change only there.
Buffers, which a forward pass may change, are cloned before the save returns (see ModelState).

torch 2.11's DefaultStager closes its copier at the end of every stage, so that its second
stage fails (`KeyError: <class 'type'>`) and keeps no buffers; newer torch reuses one copier
from save to save. Where the installed torch is of the first kind (found by staging a small
dict twice), every save gets a DefaultStager of its own (`StagerPerSave`), and the log says so.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from titan_core.compat import note_missing

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
        return default_stager(PINNED)
    return BackgroundStager() if background else default_stager(PLAIN)


def default_stager(options: StagingOptions) -> AsyncStager:
    """torch's DefaultStager, reused from save to save where this torch allows it."""
    if default_stager_is_reusable():
        return DefaultStager(options)
    note_missing(
        "reusable DefaultStager (it closes itself after one stage)",
        "every async save stages into CPU buffers of its own",
    )
    return StagerPerSave(options)


@cache
def default_stager_is_reusable() -> bool:
    """Whether one DefaultStager can stage twice (torch 2.11's cannot)."""
    stager = DefaultStager(PLAIN)
    try:
        for _ in range(2):
            stager.stage({"x": {"y": 1}})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


class StagerPerSave(AsyncStager):
    """A new DefaultStager for every save, closed when the next save starts (or at close)."""

    def __init__(self, options: StagingOptions) -> None:
        self._options = options
        self._stager: DefaultStager | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._current().should_synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> Future | dict[str, Any]:
        self.close()  # the previous save's staging is over: the optimizer waited for it
        self._stager = DefaultStager(self._options)
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        self._current().synchronize_staging()

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _current(self) -> DefaultStager:
        if self._stager is None:
            self._stager = DefaultStager(self._options)
        return self._stager


class BackgroundStager(AsyncStager):
    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._copier = default_stager(PLAIN)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-ckpt-stage")

    def stage(self, state_dict: dict[str, Any]) -> Future:
        return self._thread.submit(self._copier.stage, state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._copier.close()
