"""The entry point through which the trainer finds this package (`titan.data` group)."""

from titan_core import DataSpec
from titan_data.loader import build_dataloader
from titan_data.tokenizer import load_tokenizer

data_spec = DataSpec(
    name="titan", build_tokenizer=load_tokenizer, build_dataloader=build_dataloader
)
