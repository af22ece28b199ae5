"""The `dcp` entry point of the `titan.checkpointers` group: what the trainer calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titan_ckpt.config import Checkpoint
from titan_ckpt.manager import CheckpointManager
from titan_ckpt.preflight import check_loadable, check_space
from titan_ckpt.storage import join
from titan_core import dp_coordinates
from titan_core.protocols import Checkpointer, HFAdapter


def build_checkpointer(
    config: Checkpoint,
    *,
    states: Mapping[str, Any],
    dump_folder: str,
    dims: Any = None,
    config_toml: str = "",
    dp_rank: int | None = None,
    hf_adapter: HFAdapter | None = None,
    **_ignored: Any,
) -> Checkpointer:
    """A `CheckpointManager` writing to `<dump_folder>/<config.folder>` (or to `config.folder`
    when it is absolute or a URL such as `s3://bucket/run`).

    `dims` (a titan_core ParallelDims with its mesh built) gives the data-parallel rank and size
    that key the data loader's state; `dp_rank` overrides the rank. Unknown keyword arguments are
    accepted and ignored so that a newer trainer can pass more than this version knows about.
    """
    dp_world = dims.dp_degree if dims is not None else 1
    if dp_rank is None:
        dp_rank = dp_coordinates(dims)[0] if dp_world > 1 else 0
    folder = join(dump_folder, config.folder)  # an absolute path or a URL stays as it is
    return CheckpointManager(
        config,
        states,
        folder,
        config_toml=config_toml,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        hf_adapter=hf_adapter,
    )


# The trainer asks the factory it resolved whether the checkpoint a job would resume from fits
# the job's model (the dry run), and whether the job's checkpoints fit on their disk (before
# training); see `titan_core.protocols.Checkpointer`.
build_checkpointer.check_loadable = check_loadable  # type: ignore[attr-defined]
build_checkpointer.check_space = check_space  # type: ignore[attr-defined]
