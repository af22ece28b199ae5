"""Titan model zoo: model families registered under the `titan.models` entry-point group."""

import importlib.metadata

from titan_models import llama3
from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder, DecoderBlock
from titan_models.generation import KVCache, Sampling, generate, next_token
from titan_models.hf_adapter import DecoderHFAdapter

# The reference family's API at the top level, as `titan_models.llama3.__all__` lists it.
from titan_models.llama3 import *  # noqa: F403

__version__ = importlib.metadata.version("titan-llm-models")  # the pyproject's version, one source

__all__ = [
    "Decoder",
    "DecoderBlock",
    "DecoderHFAdapter",
    "GroupedQueryAttention",
    "KVCache",
    "Sampling",
    "generate",
    "next_token",
    *llama3.__all__,
]
