"""A mixture-of-experts feed-forward any model family can use (`MoE`), with top-k routing,
grouped-matmul experts, shared experts and DeepSeek-V3's two load-balancing schemes."""

from titan_models.moe.args import DEBUG_BALANCING, DEBUG_CAPACITY, HF_BALANCING, MoEArgs, with_moe
from titan_models.moe.experts import GroupedExperts
from titan_models.moe.layer import MoE, SwiGLU, moe_init_plan, swiglu_init_plan
from titan_models.moe.router import TopKRouter

__all__ = [
    "DEBUG_BALANCING",
    "DEBUG_CAPACITY",
    "HF_BALANCING",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "SwiGLU",
    "TopKRouter",
    "moe_init_plan",
    "swiglu_init_plan",
    "with_moe",
]
