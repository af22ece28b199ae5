"""The entry point through which the trainer finds this package (`titan.data` group)."""

from titan_core import DataSpec
from titan_data.loader import build_dataloader
from titan_data.mixture import parse_datasets
from titan_data.reachability import check_dataset
from titan_data.sources import load_source
from titan_data.tokenizer import load_tokenizer


def describe_dataset(dataset: str, dataset_path: str | None = None) -> str:
    """What `dataset` resolves to, checked without reading it (local paths must exist; hub
    datasets are not contacted); a mixture gives each entry with its share."""
    entries = parse_datasets(dataset, dataset_path)
    described = []
    for entry in entries:
        source = load_source(entry.dataset, entry.dataset_path)
        share = f"{entry.weight / sum(e.weight for e in entries):.0%} " if len(entries) > 1 else ""
        described.append(f"{share}{source.name}: {source.description}")
    return "; ".join(described)


data_spec = DataSpec(
    name="titan",
    build_tokenizer=load_tokenizer,
    build_dataloader=build_dataloader,
    describe_dataset=describe_dataset,
    check_dataset=check_dataset,
)
