"""Everything the trainer does with data, in one place: which share of the data each rank
reads (`data_coordinates`), the loader built from the data plugin (`build_loader`), its place
in the checkpoint (`checkpointed_loader`), and the data's pre-start checks (`tokenizer_problems`,
`dataset_problems`)."""

from titan_trainer.data.checks import dataset_problems, tokenizer_problems
from titan_trainer.data.loader import (
    build_checked_loader,
    build_loader,
    data_coordinates,
    skipped_rows_total,
)
from titan_trainer.data.state import GlobalLoaderState, checkpointed_loader

__all__ = [
    "GlobalLoaderState",
    "build_checked_loader",
    "build_loader",
    "checkpointed_loader",
    "data_coordinates",
    "dataset_problems",
    "skipped_rows_total",
    "tokenizer_problems",
]
