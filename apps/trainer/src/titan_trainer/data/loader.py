"""The training data loader: which share of the data this rank reads, the data plugin's loader
built with the run's keys, its refusals said in the run's terms, and the bad rows it skipped."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_core import ConfigError, NamesItsOption, ParallelDims, dp_coordinates
from titan_trainer.batch import BatchShape
from titan_trainer.guards import StartupError


def data_coordinates(config, dims: ParallelDims) -> tuple[int, int]:
    """(this rank's index among every data-parallel rank of the job, their number): the replica
    groups ([fault_tolerance]) split the data between them, each group's data-parallel ranks
    split its share."""
    dp_rank, dp_world = dp_coordinates(dims)
    ft = config.fault_tolerance
    if not ft.enable:
        return dp_rank, dp_world
    return ft.replica_id * dp_world + dp_rank, ft.group_size * dp_world


def build_loader(config, data, tokenizer, dims: ParallelDims, batch: BatchShape | None = None):
    """One loader per data-parallel rank; TP/CP/PP peers of a rank read the same batches.
    Replica groups ([fault_tolerance]) each read their own share. The global batch (`batch`,
    the layout's: samples per optimizer step over every data-parallel rank) fixes the data's
    global order, so a job resumed on another data-parallel degree with the same global batch
    sees the same samples."""
    dp_rank, dp_world = data_coordinates(config, dims)
    t = config.training
    per_group = (batch or BatchShape.of(t, dims.dp_degree)).global_size
    kwargs = dict(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        text_field=t.dataset_text_field,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        bad_rows=t.bad_rows,
        global_batch_size=per_group * (dp_world // dims.dp_degree),
        num_workers=t.dataloader.num_workers,
        prefetch_factor=t.dataloader.prefetch_factor,
        pin_memory=t.dataloader.pin_memory,
        seed=t.seed if t.seed is not None else 0,
    )
    # Built before the first step: a refusal means the run never started, as a config error.
    return build_checked_loader(data, refusal=ConfigError, **kwargs)


def build_checked_loader(data, section: str = "training", *, refusal=StartupError, **kwargs):
    """The data plugin's loader; its refusals (no tokens, bad rows, unreadable data) become a
    `refusal` (StartupError: exit 1, for a loader built once training runs; ConfigError:
    exit 2, for the training loader, built before the first step, like the data problems the
    pre-start checks find) that names the dataset keys of `section` ([training] or
    [validation])."""
    try:
        return data.build_dataloader(**kwargs)
    except (ValueError, FileNotFoundError) as e:
        # A plugin's error that can name the setting choosing the text field (titan-data's
        # MissingTextField) names ours.
        shown = (
            e.for_option(f"[{section}] dataset_text_field") if isinstance(e, NamesItsOption) else e
        )
        raise refusal(f"[{section}] dataset {kwargs.get('dataset')!r}: {shown}") from e


def skipped_rows_total(loader, dp_mesh, device: torch.device) -> int:
    """Bad rows the data-parallel ranks' loaders have skipped (`StatefulLoader.skipped_rows`),
    summed. A collective over `dp_mesh`; called at logging steps only."""
    count = torch.tensor([float(loader.skipped_rows)])
    if dp_mesh is None:
        return int(count.item())
    count = count.to(device if dp_mesh.device_type != "cpu" else "cpu")
    dist.all_reduce(count, group=dp_mesh.get_group())
    return int(count.item())
