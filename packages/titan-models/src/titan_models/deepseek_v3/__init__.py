"""DeepSeek-V3 (multi-head latent attention, mixture of experts) for Titan."""

from titan_core.protocols import ModelFeatures
from titan_models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from titan_models.deepseek_v3.flops import deepseek_v3_flops_per_token, deepseek_v3_param_count
from titan_models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from titan_models.deepseek_v3.model import DeepSeekV3Transformer
from titan_models.family import family_spec
from titan_models.moe import with_moe

deepseek_v3_spec = family_spec(
    "deepseek_v3",
    deepseek_v3_flavors,
    DeepSeekV3Transformer,
    DeepSeekV3HFAdapter,
    ModelFeatures(mtp=True),
)

__all__ = [
    "DeepSeekV3Args",
    "DeepSeekV3HFAdapter",
    "DeepSeekV3Transformer",
    "deepseek_v3_flavors",
    "deepseek_v3_flops_per_token",
    "deepseek_v3_param_count",
    "deepseek_v3_spec",
    "with_moe",
]
