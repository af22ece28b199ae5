"""Llama 3.1 / 3.2 for Titan."""

from titan_core.protocols import ModelFeatures
from titan_models.attention import check_block_causal
from titan_models.family import family_spec
from titan_models.llama3.args import LlamaArgs, llama3_flavors
from titan_models.llama3.flops import llama_flops_per_token, llama_param_count
from titan_models.llama3.hf_adapter import LlamaHFAdapter
from titan_models.llama3.model import Transformer, block_init_plan

llama3_spec = family_spec(
    "llama3",
    llama3_flavors,
    Transformer,
    LlamaHFAdapter,
    ModelFeatures(document_ids=True, block_causal_impl=True, sdpa_backend=True),
    block_causal_check=check_block_causal,
)

__all__ = [
    "LlamaArgs",
    "LlamaHFAdapter",
    "Transformer",
    "block_init_plan",
    "llama3_flavors",
    "llama3_spec",
    "llama_flops_per_token",
    "llama_param_count",
]
