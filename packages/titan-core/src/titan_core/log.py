"""Rank-aware logging: rank 0 speaks at INFO, the others only for warnings and errors."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("titan")


def init_logging(
    rank: int | None = None, level: int = logging.INFO, all_ranks: bool = False
) -> None:
    """Configure the `titan` logger once per process.

    Non-zero ranks log WARNING and above unless `all_ranks`; with several processes every line
    carries its rank so interleaved output stays readable.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank{rank}] " if world > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(level if (rank == 0 or all_ranks) else max(level, logging.WARNING))


def get_logger(name: str | None = None) -> logging.Logger:
    """The titan logger, or a child of it (`titan.<name>`), which inherits its rank filter."""
    return logger.getChild(name) if name else logger
