"""Qwen3 (dense and mixture-of-experts), written like titan-models' Llama 3.1 (see its module
docstring for the structure, the pipeline hooks and the initialisation as data). Differences:
QK-norm (an RMSNorm over each query and key head before the rotary embedding), an explicit
head size, rotary embedding in the rotate-half convention of Qwen's own code (so Hugging Face
weights load unpermuted), and `titan_models.moe.MoE` in place of the dense feed-forward in the
MoE flavors.
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
from titan_models.moe import MoE, SwiGLU
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.flops import qwen3_flops_per_token
from titan_models.weights import init_by_plan_

BASE_STD = 0.02


def build_rope_cache(args: Qwen3Args, device: torch.device | None = None) -> torch.Tensor:
    """`[max_seq_len, head_dim]` float32: cos of the angles (head_dim // 2 of them), then sin."""
    exponents = torch.arange(0, args.head_dim, 2, device=device, dtype=torch.int64).float()
    freqs = 1.0 / (args.rope_theta ** (exponents / args.head_dim))
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, seq, heads, head_dim]`: element i of the first half pairs with
    element i of the second half (rotate-half)."""
    cos, sin = rope_cache[: x.shape[1]].unsqueeze(1).chunk(2, dim=-1)
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return rotated.type_as(x)


def block_init_plan(layer_id: int, args: Qwen3Args) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    out_std = BASE_STD / math.sqrt(2 * depth)  # wo and w2 write into the residual stream
    plan = {
        f"{n}.weight": ParamInit("constant", value=1.0)
        for n in ("attention_norm", "ffn_norm", "attention.q_norm", "attention.k_norm")
    }
    for name in ("attention.wq", "attention.wk", "attention.wv"):
        plan[f"{name}.weight"] = ParamInit.truncated(BASE_STD)
    plan["attention.wo.weight"] = ParamInit.truncated(out_std)
    if args.moe is None:
        plan["feed_forward.w1.weight"] = ParamInit.truncated(BASE_STD)
        plan["feed_forward.w3.weight"] = ParamInit.truncated(BASE_STD)
        plan["feed_forward.w2.weight"] = ParamInit.truncated(out_std)
    else:
        names = ["router.gate.weight", "experts.w1", "experts.w3"]
        outs = ["experts.w2"]
        if args.moe.num_shared_experts:
            names += ["shared_experts.w1.weight", "shared_experts.w3.weight"]
            outs += ["shared_experts.w2.weight"]
        plan |= {f"feed_forward.{n}": ParamInit.truncated(BASE_STD) for n in names}
        plan |= {f"feed_forward.{n}": ParamInit.truncated(out_std) for n in outs}
        plan["feed_forward.expert_bias"] = ParamInit("constant", value=0.0)  # a buffer, saved
    return plan


class HeadNorm(nn.RMSNorm):
    """QK-norm: an RMSNorm over each head's features of [batch, seq, heads, head_dim], in
    float32 whatever the compute dtype (the projections' output may be bf16 and the scale
    fp32, or the reverse under FSDP's mixed precision), back in x's dtype. A module call, so
    that tensor parallel can hook it (TPStyle `per_head`: each rank normalises its own heads
    with the one shared weight, whose gradient is summed over the ranks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = HeadNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = HeadNorm(args.head_dim, eps=args.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_norm(self.wq(x).view(batch, seq_len, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(batch, seq_len, -1, self.head_dim))
        v = self.wv(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope_cache), apply_rope(k, rope_cache)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # [batch, heads, seq, head_dim]; the kernels read the grouped k and v heads in place.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is None:
            out = attend(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=causal_mask(start, seq_len, x.device),
                enable_gqa=self.n_rep > 1,
            )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3Args):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = (
            SwiGLU(args.dim, args.hidden_dim) if args.moe is None else MoE(args.dim, args.moe)
        )

    def init_plan(self) -> dict[str, ParamInit]:
        return block_init_plan(self.layer_id, self.args)

    def forward(
        self,
        x,
        rope_cache,
        kv_cache: LayerCache | None = None,
        start: int = 0,
        mask: AttentionMask | None = None,
    ):
        h = x + self.attention(self.attention_norm(x), rope_cache, kv_cache, start, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3Transformer(nn.Module):
    """Qwen3 decoder; satisfies `titan_core.protocols.ParallelizableModel` like titan-models'
    Llama `Transformer` (same attribute names, pipeline hooks and initialisation)."""

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        self.register_buffer("rope_cache", build_rope_cache(args), persistent=False)

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

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = build_rope_cache(self.args, device)
        for moe in self._moe_layers():  # load counts since the last bias update: none yet
            moe.tokens_per_expert = torch.zeros_like(moe.tokens_per_expert, device=device)
            # State, not a table: its values (from init_plan or a checkpoint) are kept.
            moe.expert_bias = moe.expert_bias.to(device)

    def _moe_layers(self) -> list[MoE]:
        return [b.feed_forward for b in self.layers.values() if isinstance(b.feed_forward, MoE)]

    def init_weights(
        self, buffer_device: torch.device | None = None, *, seed: int | None = None
    ) -> None:
        self.init_buffers(buffer_device)
        init_by_plan_(self, seed)

    def forward(
        self,
        tokens: torch.Tensor,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (see Llama's `Transformer.forward`; `document_ids` makes the attention
        block-causal over packed documents)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if kv_cache is None:
            mask = build_attention_mask(document_ids)
            for block in self.layers.values():
                h = block(h, self.rope_cache, mask=mask)
        else:
            start, seq_len = kv_cache.pos, tokens.shape[1]
            kv_cache.check_room(seq_len)
            rope = self.rope_cache[start : start + seq_len]
            for name, block in self.layers.items():
                h = block(h, rope, kv_cache.layer(name), start)
            kv_cache.pos += seq_len
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def tp_plan(self) -> TPPlan:
        """Attention and the dense feed-forward. A MoE layer is split by its own plan
        (`MoE.moe_plan()`, which titan-parallel reads under TP and EP), not by this one."""
        block = {
            "attention_norm": "sequence_parallel",
            "attention": "block_input",
            "attention.wq": "colwise",
            "attention.wk": "colwise",
            "attention.wv": "colwise",
            "attention.wo": "rowwise",
            "attention.q_norm": "per_head",
            "attention.k_norm": "per_head",
            "ffn_norm": "sequence_parallel",
        }
        if self.args.moe is None:
            block |= {
                "feed_forward": "block_input",
                "feed_forward.w1": "colwise",
                "feed_forward.w3": "colwise",
                "feed_forward.w2": "rowwise",
            }
        return TPPlan(
            root={"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"},
            block=block,
            divisible_by_tp={"n_heads": self.args.n_heads, "n_kv_heads": self.args.n_kv_heads},
        )

    def cp_buffers(self) -> dict[str, int]:
        return {"rope_cache": 0}

    def flops_per_token(self, seq_len: int) -> float:
        return qwen3_flops_per_token(self.args, seq_len)
