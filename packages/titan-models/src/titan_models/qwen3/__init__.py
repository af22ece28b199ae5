"""Qwen3 (dense and mixture-of-experts) for Titan."""

from titan_core.protocols import ModelFeatures, ModelSpec
from titan_models.attention import check_block_causal
from titan_models.moe import with_moe
from titan_models.options import configure_args
from titan_models.qwen3.args import Qwen3Args, qwen3_flavors
from titan_models.qwen3.flops import qwen3_flops_per_token, qwen3_param_count
from titan_models.qwen3.hf_adapter import Qwen3HFAdapter
from titan_models.qwen3.model import Qwen3Transformer

qwen3_spec = ModelSpec(
    name="qwen3",
    flavors=qwen3_flavors,
    build=Qwen3Transformer,
    hf_adapter=Qwen3HFAdapter,
    block_causal_check=check_block_causal,
    features=ModelFeatures(document_ids=True, block_causal_impl=True, sdpa_backend=True),
    configure=configure_args,
)

__all__ = [
    "Qwen3Args",
    "Qwen3HFAdapter",
    "Qwen3Transformer",
    "qwen3_flavors",
    "qwen3_flops_per_token",
    "qwen3_param_count",
    "qwen3_spec",
    "with_moe",
]
