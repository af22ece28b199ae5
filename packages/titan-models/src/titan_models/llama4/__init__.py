"""Llama 4 (text: Scout and Maverick shapes) for Titan."""

from titan_core.protocols import ModelFeatures
from titan_models.family import family_spec
from titan_models.llama4.args import Llama4Args, llama4_flavors
from titan_models.llama4.flops import llama4_flops_per_token, llama4_param_count
from titan_models.llama4.hf_adapter import Llama4HFAdapter
from titan_models.llama4.model import Llama4Transformer
from titan_models.moe import with_moe

llama4_spec = family_spec(
    "llama4", llama4_flavors, Llama4Transformer, Llama4HFAdapter, ModelFeatures(sdpa_backend=True)
)

__all__ = [
    "Llama4Args",
    "Llama4HFAdapter",
    "Llama4Transformer",
    "llama4_flavors",
    "llama4_flops_per_token",
    "llama4_param_count",
    "llama4_spec",
    "with_moe",
]
