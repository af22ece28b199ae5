"""titan-data: tokenizers, document sources, packing and checkpointable loading for Titan."""

import importlib.metadata

from titan_data.byte_tokenizer import ByteTokenizer
from titan_data.llama3_tokenizer import Llama3Tokenizer
from titan_data.loader import TitanDataLoader, build_dataloader
from titan_data.pydocs import pydocs_documents
from titan_data.sources import HUB_DATASETS, DataError, Source, load_source
from titan_data.spec import data_spec
from titan_data.tokenizer import find_tokenizer_model, load_tokenizer

__version__ = importlib.metadata.version("titan-data")  # the pyproject's version, one source

__all__ = [
    "HUB_DATASETS",
    "ByteTokenizer",
    "DataError",
    "Llama3Tokenizer",
    "Source",
    "TitanDataLoader",
    "build_dataloader",
    "data_spec",
    "find_tokenizer_model",
    "load_source",
    "load_tokenizer",
    "pydocs_documents",
]
