"""Llama 3.1: the shared decoder (`titan_models.decoder`, which documents the structure, the
pipeline hooks and the initialisation) with grouped-query attention, Llama 3.1's rotary
embedding (`rope.py`) on Meta's interleaved pairs, and a SwiGLU feed-forward. Attention is
causal, or block-causal over packed documents when `forward` gets `document_ids` (see
`titan_models.attention`)."""

from __future__ import annotations

import torch

from titan_core.init import ParamInit
from titan_models.attention import GroupedQueryAttention
from titan_models.decoder import Decoder
from titan_models.decoder import block_init_plan as decoder_block_init_plan
from titan_models.llama3.args import LlamaArgs
from titan_models.llama3.flops import llama_flops_per_token
from titan_models.llama3.rope import build_rope_cache


def block_init_plan(layer_id: int, args: LlamaArgs) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block."""
    return decoder_block_init_plan(layer_id, args, GroupedQueryAttention, moe=None)


class Transformer(Decoder):
    """Llama 3 decoder (see `Decoder`: built on meta, then `to_empty` and `init_weights`)."""

    args: LlamaArgs

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return {"rope_cache": build_rope_cache(self.args, device)}

    def dense_hidden_dim(self) -> int:
        return self.args.ffn_hidden_dim

    def flops_per_token(self, seq_len: int) -> float:
        return llama_flops_per_token(self.args, seq_len)
