"""Llama 4 (text), written like titan-models' Llama 3.1 (see its module docstring for the
structure, the pipeline hooks and the initialisation as data), with the differences listed in
`llama4/args.py`: experts in every `interleave_moe_layer_step`-th block (`feed_forward` is a
`titan_models.moe.MoE` there, a dense SwiGLU elsewhere), and two kinds of attention block:

- rotary blocks: Llama 3's interleaved rotary embedding (Meta's and Hugging Face's Llama 4
  convention, so weights load unpermuted), then the optional QK-norm, then causal attention
  within chunks of `attention_chunk_size` positions (position p sees q <= p with
  p // chunk == q // chunk);
- global blocks (every `nope_layer_interval`-th): no position embedding, queries multiplied
  by the temperature of their position, causal attention over the whole sequence.

The root owns two non-persistent tables indexed by position, both declared to context
parallel (`cp_buffers`): `rope_cache` and `attn_temperature` ([max_seq_len]).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPPlan
from titan_models.generation import KVCache, LayerCache, causal_mask
from titan_models.llama3.rope import apply_rope, build_rope_cache
from titan_models.llama4.args import Llama4Args
from titan_models.llama4.flops import llama4_flops_per_token
from titan_models.moe import MoE, SwiGLU
from titan_models.weights import init_by_plan_

BASE_STD = 0.02
_DENSE_FFN_PLAN = {
    "feed_forward": "block_input",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}


def build_temperature(args: Llama4Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len]` float32: the factor the global blocks multiply each position's queries by."""
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    if not args.attn_temperature_tuning:
        return torch.ones_like(positions)
    steps = torch.floor((positions + 1) / args.floor_scale)
    return torch.log1p(steps) * args.attn_scale + 1


def block_init_plan(layer_id: int, args: Llama4Args) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    out_std = BASE_STD / math.sqrt(2 * depth)  # wo and w2 write into the residual stream
    plan = {f"{n}.weight": ParamInit("constant", value=1.0) for n in ("attention_norm", "ffn_norm")}
    for name in ("wq", "wk", "wv"):
        plan[f"attention.{name}.weight"] = ParamInit.truncated(BASE_STD)
    plan["attention.wo.weight"] = ParamInit.truncated(out_std)
    if not args.is_moe_layer(layer_id):
        plan["feed_forward.w1.weight"] = ParamInit.truncated(BASE_STD)
        plan["feed_forward.w3.weight"] = ParamInit.truncated(BASE_STD)
        plan["feed_forward.w2.weight"] = ParamInit.truncated(out_std)
        return plan
    names = ["router.gate.weight", "experts.w1", "experts.w3"]
    outs = ["experts.w2"]
    if args.moe.num_shared_experts:
        names += ["shared_experts.w1.weight", "shared_experts.w3.weight"]
        outs += ["shared_experts.w2.weight"]
    plan |= {f"feed_forward.{n}": ParamInit.truncated(BASE_STD) for n in names}
    plan |= {f"feed_forward.{n}": ParamInit.truncated(out_std) for n in outs}
    # A buffer, but state (saved, loaded with the weights): unbiased routing to start with.
    return plan | {"feed_forward.expert_bias": ParamInit("constant", value=0.0)}


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


class Attention(nn.Module):
    def __init__(self, layer_id: int, args: Llama4Args):
        super().__init__()
        self.args = args
        self.use_rope = args.uses_rope(layer_id)
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        temperature: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """`rope_cache` and `temperature` hold the rows of x's positions. With `kv_cache`
        (generation), x's positions start at `start` and attend to the cached ones too."""
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        if self.use_rope:
            q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
            if self.args.use_qk_norm:
                q, k = _l2_norm(q, self.args.norm_eps), _l2_norm(k, self.args.norm_eps)
        elif self.args.attn_temperature_tuning:
            q = (q * temperature[:seq_len].view(1, seq_len, 1, 1)).type_as(q)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # [batch, heads, seq, head_dim]; the kernels read the grouped k and v heads in place.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = self.n_rep > 1
        chunk = self.args.attention_chunk_size
        if kv_cache is not None:
            if self.use_rope:
                mask = chunked_mask(start, seq_len, chunk, x.device)
            else:
                mask = causal_mask(start, seq_len, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif self.use_rope:
            out = chunked_causal_attention(q, k, v, chunk)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama4Args):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(layer_id, args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = (
            MoE(args.dim, args.moe)
            if args.is_moe_layer(layer_id)
            else SwiGLU(args.dim, args.hidden_dim)
        )

    def init_plan(self) -> dict[str, ParamInit]:
        return block_init_plan(self.layer_id, self.args)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        temperature: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        attention = self.attention(self.attention_norm(x), rope_cache, temperature, kv_cache, start)
        h = x + attention
        return h + self.feed_forward(self.ffn_norm(h))


class Llama4Transformer(nn.Module):
    """Llama 4 text decoder; satisfies `titan_core.protocols.ParallelizableModel` like
    titan-models' Llama `Transformer` (same attribute names, pipeline hooks and
    initialisation), including generation with `kv_cache=`."""

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, args: Llama4Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        # Functions of args, never checkpointed; indexed by position (context parallel cuts them).
        self.register_buffer("rope_cache", build_rope_cache(args), persistent=False)
        self.register_buffer("attn_temperature", build_temperature(args), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # re-tie after every conversion (see Llama's Transformer)
        self._tie_weights()
        return self

    def _tie_weights(self) -> None:
        if not self.args.tie_word_embeddings or self.tok_embeddings is None or self.output is None:
            return
        if self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def init_plan(self) -> dict[str, ParamInit]:
        plan: dict[str, ParamInit] = {}
        for i in range(self.args.n_layers):
            plan.update({f"layers.{i}.{n}": p for n, p in block_init_plan(i, self.args).items()})
        plan["norm.weight"] = ParamInit("constant", value=1.0)
        if self.args.tie_word_embeddings:
            shared = ParamInit.truncated(self.args.dim**-0.5, key="output.weight")
            plan["tok_embeddings.weight"] = plan["output.weight"] = shared
        else:
            plan["tok_embeddings.weight"] = ParamInit("normal", std=1.0)
            plan["output.weight"] = ParamInit.truncated(self.args.dim**-0.5)
        return plan

    def _moe_layers(self) -> list[MoE]:
        return [b.feed_forward for b in self.layers.values() if isinstance(b.feed_forward, MoE)]

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = build_rope_cache(self.args, device)
        self.attn_temperature = build_temperature(self.args, device)
        for moe in self._moe_layers():  # load counts since the last bias update: none yet
            moe.tokens_per_expert = torch.zeros_like(moe.tokens_per_expert, device=device)
            # State, not a table: its values (from init_plan or a checkpoint) are kept.
            moe.expert_bias = moe.expert_bias.to(device)

    def init_weights(
        self, buffer_device: torch.device | None = None, *, seed: int | None = None
    ) -> None:
        self.init_buffers(buffer_device)
        init_by_plan_(self, seed)

    def forward(self, tokens: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Logits of every position of `tokens`; with `kv_cache`, the tokens continue the
        positions the cache holds (see `titan_models.generation`)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if kv_cache is None:
            for block in self.layers.values():
                h = block(h, self.rope_cache, self.attn_temperature)
        else:
            start, seq_len = kv_cache.pos, tokens.shape[1]
            kv_cache.check_room(seq_len)
            rows = slice(start, start + seq_len)
            for name, block in self.layers.items():
                cache = kv_cache.layer(name)
                h = block(h, self.rope_cache[rows], self.attn_temperature[rows], cache, start)
            kv_cache.pos += seq_len
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def tp_plan(self) -> TPPlan:
        """Llama's plan for attention, and for the dense feed-forward in the dense blocks
        (`blocks` when the others have experts); a MoE layer is split by its own plan, not
        by this one."""
        block = {
            "attention_norm": "sequence_parallel",
            "attention": "block_input",
            "attention.wq": "colwise",
            "attention.wk": "colwise",
            "attention.wv": "colwise",
            "attention.wo": "rowwise",
            "ffn_norm": "sequence_parallel",
        }
        dense = block | _DENSE_FFN_PLAN
        moe_blocks = [i for i in range(self.args.n_layers) if self.args.is_moe_layer(i)]
        return TPPlan(
            root={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
            block=block if moe_blocks else dense,
            blocks={
                str(i): dense
                for i in range(self.args.n_layers)
                if moe_blocks and i not in moe_blocks
            },
            divisible_by_tp={"n_heads": self.args.n_heads, "n_kv_heads": self.args.n_kv_heads},
        )

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
        return {"rope_cache": 0, "attn_temperature": 0}

    def flops_per_token(self, seq_len: int) -> float:
        return llama4_flops_per_token(self.args, seq_len)
