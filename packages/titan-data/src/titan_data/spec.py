"""The entry point through which the trainer finds this package (`titan.data` group)."""

from titan_core import DataSpec
from titan_data.loader import build_dataloader
from titan_data.sources import load_source
from titan_data.tokenizer import load_tokenizer


def describe_dataset(dataset: str, dataset_path: str | None = None) -> str:
    """What `dataset` resolves to, checked without reading it (local paths must exist; hub
    datasets are not contacted)."""
    source = load_source(dataset, dataset_path)
    return f"{source.name}: {source.description}"


data_spec = DataSpec(
    name="titan",
    build_tokenizer=load_tokenizer,
    build_dataloader=build_dataloader,
    describe_dataset=describe_dataset,
)
