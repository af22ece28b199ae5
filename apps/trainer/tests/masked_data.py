"""A data package (`masked_data:data_spec`) whose held-out batches count uneven numbers of
tokens: sample g of each global batch (the same sample whatever the layout: data-parallel rank
r holds samples r x batch_size ...) keeps the first seq_len // (g + 1) of its labels and marks
the others -100, which the loss ignores. With two data-parallel ranks, rank 0 then counts
about three times the tokens of rank 1, so only a mean weighted by tokens equals one
process's. Training batches are left alone."""

from __future__ import annotations

from stall_data import WrappedLoader

from titan_core import DataSpec
from titan_data import build_dataloader, load_tokenizer
from titan_data.spec import describe_dataset


class MaskedLoader(WrappedLoader):
    def __init__(self, inner, first: int):
        super().__init__(inner)
        self.first = first  # the global index of this rank's first sample in a batch

    def __iter__(self):
        for inputs, labels in self.inner:
            labels = labels.clone()
            for row in range(labels.shape[0]):
                keep = labels.shape[1] // (self.first + row + 1)
                labels[row, keep:] = -100
            yield inputs, labels


def _build(**kwargs):
    loader = build_dataloader(**kwargs)
    if kwargs.get("infinite", True):
        return loader
    return MaskedLoader(loader, kwargs.get("dp_rank", 0) * kwargs["batch_size"])


data_spec = DataSpec(
    name="masked",
    build_tokenizer=load_tokenizer,
    build_dataloader=_build,
    describe_dataset=describe_dataset,
)
