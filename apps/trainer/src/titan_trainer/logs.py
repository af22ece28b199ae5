"""Which ranks speak on the console, and each rank's log file.

Every rank appends what it logs to `<dump_folder>/<logging.folder>/rank_<n>.log` (each line
with its rank and date; a resumed run appends). The console shows INFO lines from the ranks
`logging.ranks` names (else the LOG_RANK environment variable, as torchtitan's launch script
spells it, else rank 0) and warnings and errors from every rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from titan_core import get_logger, init_logging
from titan_core.log import log_to_file

log = get_logger("logs")


def ranks_text(section) -> str:
    """`logging.ranks`, else LOG_RANK, else "0"."""
    if section.ranks is not None:
        return section.ranks
    return os.environ.get("LOG_RANK", "").strip() or "0"


def parse_ranks(text: str, world_size: int | None = None) -> list[int]:
    """`0`, `0,3`, `0-3,7` or `all` as a sorted list of ranks (`all` needs `world_size`).
    Raises ValueError saying what is wrong."""
    text = text.strip()
    if text == "all":
        if world_size is None:
            return []
        return list(range(world_size))
    ranks: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a rank or a range of ranks") from None
        if low < 0 or high < low:
            raise ValueError(f"{part.strip()!r} is not a rank or a range of ranks")
        ranks.update(range(low, high + 1))
    return sorted(ranks)


def rank_problems(section, world_size: int) -> list[str]:
    """The ranks chosen for the console, checked against the job's size."""
    text = ranks_text(section)
    where = "[logging] ranks" if section.ranks is not None else "LOG_RANK"
    try:
        ranks = parse_ranks(text, world_size)
    except ValueError as e:
        return [f"{where} = {text!r}: {e}\nuse ranks such as 0, 0,3, 0-3 or all"]
    beyond = [r for r in ranks if r >= world_size]
    if beyond:
        return [
            f"{where} = {text!r} names rank {beyond[0]}, but the job has {world_size} "
            f"process{'es' if world_size > 1 else ''}\nuse ranks from 0 to {world_size - 1}, or all"
        ]
    return []


def choose_console_ranks(section, rank: int | None = None, world_size: int = 1) -> None:
    """The console shows INFO lines from the ranks `section` (`[logging]`) chooses."""
    init_logging(rank, console_ranks=parse_ranks(ranks_text(section), world_size))


@contextlib.contextmanager
def rank_logging(section, dump_folder: str, rank: int, world_size: int) -> Iterator[None]:
    """The console shows the chosen ranks; this rank's file takes every line while the block
    runs (from the process's first line on), and the error that ends it, if one does."""
    choose_console_ranks(section, rank, world_size)
    if not section.folder:
        yield
        return
    path = os.path.join(dump_folder, section.folder, f"rank_{rank}.log")
    with log_to_file(path, rank):
        log.info("rank %d of %d logs to %s", rank, world_size, path)
        yield
