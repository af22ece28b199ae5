"""The `dcp` entry point of the `titan.checkpointers` group: what the trainer calls."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from titan_ckpt.config import Checkpoint
from titan_ckpt.manager import CheckpointManager
from titan_ckpt.preflight import check_loadable, check_space, resume_point
from titan_ckpt.storage import join
from titan_core import dp_coordinates
from titan_core.protocols import Checkpointer, CheckpointerPlugin, HFAdapter, ResumePoint


class DCPCheckpointerFactory(CheckpointerPlugin):
    """The `dcp` checkpointer: builds a `CheckpointManager`; checks a checkpoint against a
    layout offline (`check_loadable`, the trainer's dry run) and the disk of its folder
    (`check_space`, before training); finds the checkpoint a resume loads (`resume_point`)."""

    def __call__(self, config: Checkpoint, **kwargs: Any) -> Checkpointer:
        return _build_checkpointer(config, **kwargs)

    def check_loadable(
        self, config: Any, dump_folder: str, expected: Mapping[str, tuple[int, ...]]
    ) -> tuple[list[str], str | None]:
        return check_loadable(config, dump_folder, expected)

    def check_space(
        self, config: Any, dump_folder: str, state_bytes: int, steps: int
    ) -> tuple[list[str], str | None]:
        return check_space(config, dump_folder, state_bytes, steps)

    def resume_point(self, config: Any, dump_folder: str) -> ResumePoint | None:
        return resume_point(config, dump_folder)


def _build_checkpointer(
    config: Checkpoint,
    *,
    states: Mapping[str, Any],
    dump_folder: str,
    dims: Any = None,
    config_toml: str = "",
    dp_rank: int | None = None,
    hf_adapter: HFAdapter | None = None,
    hf_extra_files: Callable[[Path], Any] | None = None,
    **_ignored: Any,
) -> Checkpointer:
    """A `CheckpointManager` writing to `<dump_folder>/<config.folder>` (or to `config.folder`
    when it is absolute or a URL such as `s3://bucket/run`).

    `dims` (a titan_core ParallelDims with its mesh built) gives the data-parallel rank and size
    that key the data loader's state; `dp_rank` overrides the rank. `hf_extra_files(folder)`
    adds files to each Hugging Face snapshot (`hf_interval`; the trainer's tokenizer files). Unknown keyword arguments are
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
        hf_extra_files=hf_extra_files,
    )


build_checkpointer = DCPCheckpointerFactory()
"""The `titan.checkpointers` entry point `dcp`: `build_checkpointer(config, states=...,
dump_folder=...)`, `build_checkpointer.check_loadable(...)`, `build_checkpointer.check_space(...)`,
`build_checkpointer.resume_point(...)`."""
