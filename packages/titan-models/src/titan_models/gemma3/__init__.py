"""Gemma 3 (text decoders) for Titan."""

from titan_core.protocols import ModelFeatures
from titan_models.attention import check_block_causal
from titan_models.family import family_spec
from titan_models.gemma3.args import Gemma3Args, gemma3_flavors
from titan_models.gemma3.flops import gemma3_flops_per_token, gemma3_param_count
from titan_models.gemma3.hf_adapter import Gemma3HFAdapter
from titan_models.gemma3.model import Gemma3Transformer

gemma3_spec = family_spec(
    "gemma3",
    gemma3_flavors,
    Gemma3Transformer,
    Gemma3HFAdapter,
    ModelFeatures(document_ids=True, block_causal_impl=True, sdpa_backend=True),
    block_causal_check=check_block_causal,
)

__all__ = [
    "Gemma3Args",
    "Gemma3HFAdapter",
    "Gemma3Transformer",
    "gemma3_flavors",
    "gemma3_flops_per_token",
    "gemma3_param_count",
    "gemma3_spec",
]
