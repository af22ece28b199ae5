"""Llama 4 (text: Scout and Maverick shapes) for Titan."""

from titan_core.protocols import ModelFeatures, ModelSpec
from titan_models.llama4.args import Llama4Args, llama4_flavors
from titan_models.llama4.flops import llama4_flops_per_token, llama4_param_count
from titan_models.llama4.hf_adapter import Llama4HFAdapter
from titan_models.llama4.model import Llama4Transformer
from titan_models.moe import with_moe
from titan_models.options import configure_args

llama4_spec = ModelSpec(
    name="llama4",
    flavors=llama4_flavors,
    build=Llama4Transformer,
    hf_adapter=Llama4HFAdapter,
    features=ModelFeatures(sdpa_backend=True),
    configure=configure_args,
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
