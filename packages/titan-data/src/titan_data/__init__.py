"""titan-data: tokenizers, document sources, packing and checkpointable loading for Titan."""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING

__version__ = importlib.metadata.version("titan-llm-data")  # the pyproject's version, one source

# The public API, by the module that defines it. Imported on first use, so that the
# `titan-data` command (titan_data.cli) starts without torch and `datasets`, which take seconds.
_EXPORTS = {
    "ByteTokenizer": "titan_data.byte_tokenizer",
    "DataError": "titan_data.errors",
    "HFTokenizer": "titan_data.hf_tokenizer",
    "HUB_DATASETS": "titan_data.sources",
    "Layout": "titan_data.order",
    "Llama3Tokenizer": "titan_data.llama3_tokenizer",
    "MissingTextField": "titan_data.errors",
    "Source": "titan_data.sources",
    "TitanDataLoader": "titan_data.loader",
    "TokenShards": "titan_data.token_shards",
    "build_dataloader": "titan_data.loader",
    "data_spec": "titan_data.spec",
    "find_tokenizer_file": "titan_data.tokenizer",
    "find_tokenizer_model": "titan_data.tokenizer",
    "load_source": "titan_data.sources",
    "load_tokenizer": "titan_data.tokenizer",
    "parse_datasets": "titan_data.mixture",
    "pydocs_documents": "titan_data.pydocs",
}
__all__ = [
    "HUB_DATASETS",
    "HFTokenizer",
    "ByteTokenizer",
    "DataError",
    "Layout",
    "Llama3Tokenizer",
    "MissingTextField",
    "Source",
    "TitanDataLoader",
    "TokenShards",
    "build_dataloader",
    "data_spec",
    "find_tokenizer_file",
    "find_tokenizer_model",
    "load_source",
    "load_tokenizer",
    "parse_datasets",
    "pydocs_documents",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'titan_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from titan_data.byte_tokenizer import ByteTokenizer
    from titan_data.errors import DataError, MissingTextField
    from titan_data.hf_tokenizer import HFTokenizer
    from titan_data.llama3_tokenizer import Llama3Tokenizer
    from titan_data.loader import TitanDataLoader, build_dataloader
    from titan_data.mixture import parse_datasets
    from titan_data.order import Layout
    from titan_data.pydocs import pydocs_documents
    from titan_data.sources import HUB_DATASETS, Source, load_source
    from titan_data.spec import data_spec
    from titan_data.token_shards import TokenShards
    from titan_data.tokenizer import find_tokenizer_file, find_tokenizer_model, load_tokenizer
