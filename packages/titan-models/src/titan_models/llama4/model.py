"""Llama 4 (text): the shared decoder (`titan_models.decoder`, which documents the structure,
the pipeline hooks and the initialisation) with the differences listed in `llama4/args.py`:
experts in every `interleave_moe_layer_step`-th block (`feed_forward` is a
`titan_models.moe.MoE` there, a dense SwiGLU elsewhere), and two kinds of attention block:

- rotary blocks: Llama 3's interleaved rotary embedding (Meta's and Hugging Face's Llama 4
  convention, so weights load unpermuted), then the optional QK-norm, then causal attention
  within chunks of `attention_chunk_size` positions (position p sees q <= p with
  p // chunk == q // chunk);
- global blocks (every `nope_layer_interval`-th): no position embedding, queries multiplied
  by the temperature of their position, causal attention over the whole sequence.

Its position tables (both declared to context parallel) are `rope_cache` and
`attn_temperature` ([max_seq_len]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_models.attention import AttentionMask, GroupedQueryAttention
from titan_models.decoder import Decoder
from titan_models.generation import KVCache
from titan_models.llama3.rope import build_rope_cache
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.flops import llama4_flops_per_token
from titan_models.moe import MoEArgs
from titan_models.rope import apply_rope


def build_temperature(args: Llama4Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len]` float32: the factor the global blocks multiply each position's queries by."""
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    if not args.attn_temperature_tuning:
        return torch.ones_like(positions)
    steps = torch.floor((positions + 1) / args.floor_scale)
    return torch.log1p(steps) * args.attn_scale + 1


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head scaled to unit root-mean-square, in float32 (QK-norm without a weight)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Causal attention within chunks of `chunk` positions ([batch, heads, seq, head_dim],
    positions starting at 0): one causal attention per chunk, no mask tensor. k and v may
    have fewer heads than q (grouped-query attention), read in place."""
    gqa = k.shape[1] < q.shape[1]
    if q.shape[2] <= chunk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    pieces = zip(q.split(chunk, dim=2), k.split(chunk, dim=2), v.split(chunk, dim=2))
    return torch.cat(
        [F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=gqa) for qkv in pieces],
        dim=2,
    )


def chunked_mask(start: int, seq_len: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Generation's chunked causal mask: which of positions 0..start+seq_len-1 each query at
    start..start+seq_len-1 may attend to, `[seq_len, start + seq_len]`."""
    queries = torch.arange(start, start + seq_len, device=device)[:, None]
    keys = torch.arange(start + seq_len, device=device)[None, :]
    return (keys <= queries) & (keys // chunk == queries // chunk)


class Attention(GroupedQueryAttention):
    """Llama 3's attention, with rotary embedding, QK-norm and chunks in the rotary blocks,
    and temperature-scaled queries over the whole sequence in the global ones."""

    def __init__(self, layer_id: int, args: Llama4Args):
        super().__init__(layer_id, args)
        self.args = args
        self.use_rope = args.uses_rope(layer_id)
        self.normalises_qk = self.use_rope and args.use_qk_norm

    def position(self, q, k, rope_cache: torch.Tensor, temperature: torch.Tensor):
        """`rope_cache` and `temperature` hold the rows of the positions of q and k."""
        if self.use_rope:
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
            if self.args.use_qk_norm:
                q, k = _l2_norm(q, self.args.norm_eps), _l2_norm(k, self.args.norm_eps)
        elif self.args.attn_temperature_tuning:
            seq_len = q.shape[1]
            q = (q * temperature[:seq_len].view(1, seq_len, 1, 1)).type_as(q)
        return q, k

    def attend(self, q, k, v, mask: AttentionMask | None) -> torch.Tensor:
        if self.use_rope:
            return chunked_causal_attention(q, k, v, self.args.attention_chunk_size)
        return super().attend(q, k, v, mask)

    def attend_cached(self, q, k, v, start: int) -> torch.Tensor:
        if not self.use_rope:
            return super().attend_cached(q, k, v, start)
        mask = chunked_mask(start, q.shape[2], self.args.attention_chunk_size, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_rep > 1)


class Llama4Transformer(Decoder):
    """Llama 4 text decoder (see `Decoder`: built on meta, then `to_empty` and
    `init_weights`), including generation with `kv_cache=`."""

    args: Llama4Args
    attention_class = Attention

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        return {
            "rope_cache": build_rope_cache(self.args, device),
            "attn_temperature": build_temperature(self.args, device),
        }

    def moe_args(self, layer_id: int) -> MoEArgs | None:
        return self.args.moe if self.args.is_moe_layer(layer_id) else None

    def forward(self, tokens: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Logits (see `Decoder.forward`), without `document_ids`: the chunked attention takes
        no block-causal mask, so the trainer refuses `attn_mask_type = "block_causal"`."""
        return super().forward(tokens, kv_cache)

    def cp_buffers(self) -> dict[str, int]:
        """Context parallel attends causally over the whole sequence; the rotary blocks'
        chunked attention is that only when the sequence fits in one chunk."""
        if self.args.max_seq_len > self.args.attention_chunk_size:
            raise ValueError(
                f"Llama 4 under context parallel needs the sequence ({self.args.max_seq_len}) to fit"
                f" in one attention chunk ({self.args.attention_chunk_size}): its rotary blocks"
                " attend within chunks, which ring attention does not do\n"
                "use a training seq_len up to the chunk size, or context_parallel_degree = 1"
            )
        return super().cp_buffers()

    def flops_per_token(self, seq_len: int) -> float:
        return llama4_flops_per_token(self.args, seq_len)
