"""Qwen3 (dense and mixture-of-experts) for Titan."""

from titan_core.protocols import ModelFeatures
from titan_models.attention import check_block_causal
from titan_models.family import family_spec
from titan_models.moe import with_moe
from titan_models.qwen3.args import Qwen3Args, qwen3_flavors
from titan_models.qwen3.flops import qwen3_flops_per_token, qwen3_param_count
from titan_models.qwen3.hf_adapter import Qwen3HFAdapter
from titan_models.qwen3.model import Qwen3Transformer

qwen3_spec = family_spec(
    "qwen3",
    qwen3_flavors,
    Qwen3Transformer,
    Qwen3HFAdapter,
    ModelFeatures(document_ids=True, block_causal_impl=True, sdpa_backend=True),
    block_causal_check=check_block_causal,
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
