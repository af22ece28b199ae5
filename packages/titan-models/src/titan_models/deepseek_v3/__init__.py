"""DeepSeek-V3 (multi-head latent attention, mixture of experts) for Titan."""

from titan_core.protocols import ModelFeatures, ModelSpec
from titan_models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_flavors
from titan_models.deepseek_v3.flops import deepseek_v3_flops_per_token, deepseek_v3_param_count
from titan_models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter
from titan_models.deepseek_v3.model import DeepSeekV3Transformer
from titan_models.moe import with_moe
from titan_models.options import configure_args

deepseek_v3_spec = ModelSpec(
    name="deepseek_v3",
    flavors=deepseek_v3_flavors,
    build=DeepSeekV3Transformer,
    hf_adapter=DeepSeekV3HFAdapter,
    features=ModelFeatures(mtp=True),
    configure=configure_args,
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
