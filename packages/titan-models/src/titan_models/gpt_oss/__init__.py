"""GPT-OSS (attention sinks, sliding windows, experts with biases and a clamped SwiGLU)."""

from titan_core.protocols import ModelFeatures
from titan_models.attention import check_block_causal
from titan_models.family import family_spec
from titan_models.gpt_oss.args import GptOssArgs, gpt_oss_flavors
from titan_models.gpt_oss.flops import gpt_oss_flops_per_token, gpt_oss_param_count
from titan_models.gpt_oss.hf_adapter import GptOssHFAdapter
from titan_models.gpt_oss.model import GptOssTransformer

gpt_oss_spec = family_spec(
    "gpt_oss",
    gpt_oss_flavors,
    GptOssTransformer,
    GptOssHFAdapter,
    ModelFeatures(document_ids=True, block_causal_impl=True),
    block_causal_check=check_block_causal,
)

__all__ = [
    "GptOssArgs",
    "GptOssHFAdapter",
    "GptOssTransformer",
    "gpt_oss_flavors",
    "gpt_oss_flops_per_token",
    "gpt_oss_param_count",
    "gpt_oss_spec",
]
