"""Titan model zoo: model families registered under the `titan.models` entry-point group."""

import importlib.metadata

from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder, DecoderBlock
from titan_models.generation import KVCache, Sampling, generate, next_token
from titan_models.hf_adapter import DecoderHFAdapter
from titan_models.llama3 import (
    LlamaArgs,
    LlamaHFAdapter,
    Transformer,
    block_init_plan,
    llama3_flavors,
    llama3_spec,
    llama_flops_per_token,
    llama_param_count,
)

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
    "LlamaArgs",
    "LlamaHFAdapter",
    "Transformer",
    "block_init_plan",
    "llama3_flavors",
    "llama3_spec",
    "llama_flops_per_token",
    "llama_param_count",
]
