"""Titan model zoo: model families registered under the `titan.models` entry-point group."""

import importlib.metadata
from typing import TYPE_CHECKING

from titan_core.lazy import attach

# The public API, each name imported from its module on first use (titan_core.lazy): a
# trainer reads its `[model]` keys (`titan_models.options`) before torch's seconds of import.
if TYPE_CHECKING:
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
    from titan_models.options import ModelOptions, configure_args

__getattr__, __dir__ = attach(__name__, __file__)

__version__ = importlib.metadata.version("titan-llm-models")  # the pyproject's version, one source

# The reference family's API is at the top level too, as `titan_models.llama3.__all__` lists it.
__all__ = [
    "Decoder",
    "DecoderBlock",
    "DecoderHFAdapter",
    "GroupedQueryAttention",
    "KVCache",
    "LlamaArgs",
    "LlamaHFAdapter",
    "ModelOptions",
    "Sampling",
    "Transformer",
    "block_init_plan",
    "configure_args",
    "generate",
    "llama3_flavors",
    "llama3_spec",
    "llama_flops_per_token",
    "llama_param_count",
    "next_token",
]
