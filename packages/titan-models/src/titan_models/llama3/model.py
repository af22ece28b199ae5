"""Llama 3.1, written for reading and for parallelism.

Structure: `tok_embeddings` -> `layers` ("0".."n-1", each RMSNorm -> attention -> residual,
RMSNorm -> SwiGLU -> residual) -> `norm` -> `output`. Attention is grouped-query, causal, or
block-causal over packed documents when `forward` gets `document_ids` (see
`titan_models.attention`); rotary embeddings come from a non-persistent buffer
`rope_cache` owned by the root (see `rope.py`). Nothing is global: a module's behaviour depends
only on its `LlamaArgs`.

Parallelism hooks: heads are always reshaped with -1 so tensor parallel can shard them;
pipeline parallel may delete blocks from `layers` and set `tok_embeddings`, `norm` or `output`
to None, in which case `forward` passes its input through that step unchanged.

Initialisation (`init_weights`, after `to_empty`) is data: `init_plan()` gives each parameter a
`titan_core.ParamInit`, and its values are a function of (seed, parameter name) only, so every
layout (FSDP, TP, pipeline stages) starts from exactly the weights one process draws. Every
draw is truncated at 3 standard deviations except the embedding:
- `tok_embeddings`: normal(0, 1), since the first RMSNorm rescales it anyway.
- wq, wk, wv, w1, w3: std 0.02.
- wo, w2 (they write into the residual stream): std 0.02 / sqrt(2 * (layer_id + 1)) with
  `depth_init`, else 0.02 / sqrt(2 * n_layers), so the stream's variance does not grow with depth.
- RMSNorm scales: 1.
- `output`: std dim**-0.5, so initial logits have unit scale. With tied embeddings the shared
  matrix gets this init (normal(0, 1) would make the logits sqrt(dim) times too large).
On DTensor parameters each rank draws only the blocks of its own shard (see titan_core.init).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPPlan
from titan_models.attention import AttentionMask, attend, build_attention_mask
from titan_models.generation import KVCache, LayerCache, causal_mask
from titan_models.llama3.args import LlamaArgs
from titan_models.llama3.flops import llama_flops_per_token
from titan_models.llama3.rope import apply_rope, build_rope_cache
from titan_models.weights import init_by_plan_

BASE_STD = 0.02


def block_init_plan(layer_id: int, args: LlamaArgs) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    out_std = BASE_STD / math.sqrt(2 * depth)  # wo and w2 write into the residual stream
    plan = {f"{n}.weight": ParamInit("constant", value=1.0) for n in ("attention_norm", "ffn_norm")}
    for name in (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "feed_forward.w1",
        "feed_forward.w3",
    ):
        plan[f"{name}.weight"] = ParamInit.truncated(BASE_STD)
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"{name}.weight"] = ParamInit.truncated(out_std)
    return plan


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads  # unchanged by TP: both head counts are sharded
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        """`rope_cache` holds the rows of x's positions. With `kv_cache` (generation), x's
        positions start at `start` and attend to the cached ones before them too. `mask`
        (training on packed documents) makes the attention block-causal."""
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim)
        k = self.wk(x).view(batch, seq_len, -1, self.head_dim)
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # [batch, heads, seq, head_dim]; kv head i serves query heads i*n_rep .. (i+1)*n_rep-1,
        # which the attention kernels read in place (no repeated copy of k and v).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is None:
            out = attend(q, k, v, mask)
        else:
            cached = causal_mask(start, seq_len, x.device)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=cached, enable_gqa=self.n_rep > 1
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        hidden = args.ffn_hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def init_plan(self) -> dict[str, ParamInit]:
        """This block's parameters, by name relative to the block."""
        return block_init_plan(self.layer_id, self.args)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, kv_cache, start, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder; satisfies `titan_core.protocols.ParallelizableModel`.

    Build under `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()`.
    `forward(tokens)` maps int64 `[batch, seq]` tokens to `[batch, seq, vocab]` logits. With
    `tok_embeddings` set to None it takes hidden states `[batch, seq, dim]` instead, and with
    `norm`/`output` set to None it returns hidden states (pipeline stages).
    """

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        # Not persistent: it is a function of args, recomputed by init_weights, never checkpointed.
        self.register_buffer("rope_cache", build_rope_cache(args), persistent=False)

    def _apply(self, fn, recurse=True):
        # Module._apply gives each module a fresh Parameter when a tensor changes device type
        # (meta -> cpu in to_empty, cpu -> cuda in .to), which would silently untie the
        # embedding and output weights; every such conversion passes here, so re-tie after it.
        super()._apply(fn, recurse)
        self._tie_weights()
        return self

    def _tie_weights(self) -> None:
        if not self.args.tie_word_embeddings or self.tok_embeddings is None or self.output is None:
            return
        if self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def init_plan(self) -> dict[str, ParamInit]:
        """How every parameter of the full model starts, by fully qualified name (see the
        module docstring). Names of blocks a pipeline stage does not hold are included."""
        plan: dict[str, ParamInit] = {}
        # Built from the args, not from self.layers, so a stage knows every block's rule.
        for i in range(self.args.n_layers):
            plan.update({f"layers.{i}.{n}": p for n, p in block_init_plan(i, self.args).items()})
        plan["norm.weight"] = ParamInit("constant", value=1.0)
        if self.args.tie_word_embeddings:
            # One matrix, one draw, whichever end of a pipeline holds it.
            shared = ParamInit.truncated(self.args.dim**-0.5, key="output.weight")
            plan["tok_embeddings.weight"] = plan["output.weight"] = shared
        else:
            plan["tok_embeddings.weight"] = ParamInit("normal", std=1.0)
            plan["output.weight"] = ParamInit.truncated(self.args.dim**-0.5)
        return plan

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the rotary table (a function of args, never checkpointed)."""
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = build_rope_cache(self.args, device)

    def init_weights(
        self, buffer_device: torch.device | None = None, *, seed: int | None = None
    ) -> None:
        """Give every parameter and buffer its initial value (see the module docstring).

        `seed` defaults to torch's current seed (`torch.manual_seed(s)` then `init_weights()`
        uses s). Works on plain and on sharded (DTensor) parameters alike, and on a pipeline
        stage holding only some blocks. `buffer_device` is where the rope table is computed;
        by default where it already is.
        """
        self.init_buffers(buffer_device)
        init_by_plan_(self, seed)

    def forward(
        self,
        tokens: torch.Tensor,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of every position of `tokens`. With `kv_cache` (generation, see
        `titan_models.generation`) the tokens continue the positions the cache holds, and
        their keys and values join it. With `document_ids` (`[batch, seq]`, see
        `titan_models.attention`) a position attends only within its own document."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if kv_cache is None:
            mask = build_attention_mask(document_ids)
            for block in self.layers.values():
                h = block(h, self.rope_cache, mask=mask)
        else:
            start, seq_len = kv_cache.pos, tokens.shape[1]
            kv_cache.check_room(seq_len)
            if start + seq_len > self.rope_cache.shape[0]:
                raise ValueError(
                    f"positions up to {start + seq_len}, but the model has {self.rope_cache.shape[0]}"
                    " (its max_seq_len)"
                )
            rope = self.rope_cache[start : start + seq_len]
            for name, block in self.layers.items():
                h = block(h, rope, kv_cache.layer(name), start)
            kv_cache.pos += seq_len
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def tp_plan(self) -> TPPlan:
        return TPPlan(
            root={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
            block={
                "attention_norm": "sequence_parallel",
                "attention": "block_input",
                "attention.wq": "colwise",
                "attention.wk": "colwise",
                "attention.wv": "colwise",
                "attention.wo": "rowwise",
                "ffn_norm": "sequence_parallel",
                "feed_forward": "block_input",
                "feed_forward.w1": "colwise",
                "feed_forward.w3": "colwise",
                "feed_forward.w2": "rowwise",
            },
            divisible_by_tp={"n_heads": self.args.n_heads, "n_kv_heads": self.args.kv_heads},
        )

    def cp_buffers(self) -> dict[str, int]:
        return {"rope_cache": 0}  # one row per position

    def flops_per_token(self, seq_len: int) -> float:
        return llama_flops_per_token(self.args, seq_len)
