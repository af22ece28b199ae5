"""Rank-aware logging: every line names its rank; the console shows INFO from the ranks chosen
(rank 0 by default) and only warnings and errors from the others; `log_to_file` gives each
rank a file of its own with everything it logged, from the first line on."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Collection, Iterator

logger = logging.getLogger("titan")

# Lines logged before `log_to_file` knows where this rank's file goes (the process group and
# the run folder come later than the first lines); replayed into the file when it opens.
_EARLY_LINES_KEPT = 10_000


class _EarlyLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < _EARLY_LINES_KEPT:
            self.records.append(record)


_early = _EarlyLines()
_file_handlers: list[logging.Handler] = []


def _rank_and_world(rank: int | None) -> tuple[int, int]:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    return rank, int(os.environ.get("WORLD_SIZE", "1"))


def init_logging(
    rank: int | None = None,
    level: int = logging.INFO,
    all_ranks: bool = False,
    console_ranks: Collection[int] | None = None,
) -> None:
    """Configure the `titan` logger of this process; calling it again changes the console's
    choice of ranks and keeps the lines logged so far for `log_to_file`.

    The console shows `level` and above from `console_ranks` (default: rank 0, or every rank
    with `all_ranks`) and WARNING and above from the others. With several processes every
    console line starts with its rank, so interleaved output stays readable.
    """
    rank, world = _rank_and_world(rank)
    if console_ranks is None:
        console_ranks = range(world) if all_ranks else (0,)
    prefix = f"[rank{rank}] " if world > 1 else ""
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    console.setLevel(level if rank in console_ranks else max(level, logging.WARNING))
    keep = [h for h in logger.handlers if h is _early or h in _file_handlers]
    if not _file_handlers and _early not in keep:
        keep.append(_early)
    logger.handlers[:] = [console, *keep]
    logger.propagate = False
    logger.setLevel(level)  # the handlers choose; a rank's file gets every line at `level`


@contextlib.contextmanager
def log_to_file(path: str, rank: int | None = None) -> Iterator[str]:
    """Append everything this rank logs to `path` while the block runs: the lines logged since
    `init_logging` first, then the rest, each with its rank and date. An exception leaving the
    block is written there too (with its traceback) before it propagates, so that the file
    says why the rank stopped."""
    rank, _ = _rank_and_world(rank)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(
        logging.Formatter(
            f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"
        )
    )
    handler.setLevel(logger.level)
    for record in _early.records:
        handler.handle(record)
    _early.records.clear()
    if _early in logger.handlers:
        logger.removeHandler(_early)
    _file_handlers.append(handler)
    logger.addHandler(handler)
    try:
        yield path
    except BaseException as e:
        handler.handle(
            logger.makeRecord(
                logger.name, logging.ERROR, __file__, 0, "stopped: %s", (e,), sys.exc_info()
            )
        )
        raise
    finally:
        logger.removeHandler(handler)
        _file_handlers.remove(handler)
        handler.close()
        if not _file_handlers:
            logger.addHandler(_early)


def get_logger(name: str | None = None) -> logging.Logger:
    """The titan logger, or a child of it (`titan.<name>`), which inherits its rank filter."""
    return logger.getChild(name) if name else logger
