"""DeepSeek-V3, written like titan-models' Llama 3.1 and Qwen3 (see Llama's module docstring
for the structure, the pipeline hooks and the initialisation as data).

Each block is RMSNorm -> multi-head latent attention -> residual, RMSNorm -> feed-forward ->
residual; the feed-forward (`feed_forward`) is a dense SwiGLU in the first `n_dense_layers`
blocks and `titan_models.moe.MoE` (routed plus shared experts) in the others.

Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, section 2.1), in training form:
- queries: `wq` (dim -> heads x qk_head_dim), or with `q_lora_rank` the low-rank
  `wq_a` (dim -> q_lora_rank) -> `q_norm` -> `wq_b` (-> heads x qk_head_dim);
- keys and values: `wkv_a` (dim -> kv_lora_rank) gives the latent, `kv_norm` -> `wkv_b`
  (kv_lora_rank -> heads x (qk_nope_head_dim + v_head_dim)) rebuilds each head's position-free
  key and its value; `wk_rope` (dim -> qk_rope_head_dim) gives the rotary key part, one shared
  by every head. DeepSeek's checkpoints hold wkv_a and wk_rope as one matrix; they are two
  modules here because tensor parallel treats them differently (see `tp_plan`);
- each head's query and key are [position-free part, rotary part]; the logits are scaled by
  `softmax_scale(args)` (YaRN's mscale included), causal; `wo` maps heads x v_head_dim back.
Multi-token prediction (the paper's MTP module) is not implemented. Generation caches each
head's full keys and values (`titan_models.generation.KVCache`), not the compressed latent.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPPlan
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.flops import deepseek_v3_flops_per_token
from titan_models.deepseek_v3.rope import build_rope_cache, softmax_scale
from titan_models.generation import KVCache, LayerCache, causal_mask
from titan_models.llama3.rope import apply_rope
from titan_models.moe import MoE, SwiGLU
from titan_models.weights import init_by_plan_

BASE_STD = 0.02
_DENSE_FFN_PLAN = {
    "feed_forward": "block_input",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}
LATENT_NORM_EPS = 1e-6  # q_norm and kv_norm, as in DeepSeek's and Hugging Face's code


def _query_names(args: DeepSeekV3Args) -> list[str]:
    return ["wq_a", "wq_b"] if args.q_lora_rank else ["wq"]


def block_init_plan(layer_id: int, args: DeepSeekV3Args) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    out_std = BASE_STD / math.sqrt(2 * depth)  # wo and w2 write into the residual stream
    norms = ["attention_norm", "ffn_norm", "attention.kv_norm"]
    if args.q_lora_rank:
        norms.append("attention.q_norm")
    plan = {f"{n}.weight": ParamInit("constant", value=1.0) for n in norms}
    for name in [*_query_names(args), "wkv_a", "wk_rope", "wkv_b"]:
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


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.args = args
        self.scale = softmax_scale(args)
        qk_out = args.n_heads * args.qk_head_dim
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, qk_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, qk_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank, bias=False)
        self.wk_rope = nn.Linear(args.dim, args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        kv_cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """`rope_cache` holds the rows of x's positions. With `kv_cache` (generation), x's
        positions start at `start` and attend to the cached ones before them too."""
        a = self.args
        batch, seq_len, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if a.q_lora_rank else self.wq(x)
        # -1 heads: tensor parallel leaves each rank its own heads of wq(_b) and wkv_b.
        q = q.view(batch, seq_len, -1, a.qk_head_dim)
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(self.wkv_a(x))).view(
            batch, seq_len, -1, a.qk_nope_head_dim + a.v_head_dim
        )
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        q_rope = apply_rope(q_rope, rope_cache)
        k_rope = apply_rope(self.wk_rope(x).unsqueeze(2), rope_cache)  # one for all heads
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.update(start, k, v)
        # Values padded with zeros to the query/key size: the fused attention kernels (flash
        # on CUDA and CPU, and context parallel's ring attention over them) want one head size
        # for q, k and v; the zeros add nothing and are cut off again.
        pad = a.qk_head_dim - a.v_head_dim
        if pad > 0:
            v = F.pad(v, (0, pad))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        if kv_cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            mask = causal_mask(start, seq_len, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        out = out[..., : a.v_head_dim] if pad > 0 else out
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV3Args):
        super().__init__()
        self.layer_id = layer_id
        self.args = args
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MultiHeadLatentAttention(args)
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
        kv_cache: LayerCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, kv_cache, start)
        return h + self.feed_forward(self.ffn_norm(h))


class DeepSeekV3Transformer(nn.Module):
    """DeepSeek-V3 decoder; satisfies `titan_core.protocols.ParallelizableModel` like
    titan-models' Llama `Transformer` (same attribute names, pipeline hooks and
    initialisation), including generation with `kv_cache=`."""

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")

    def __init__(self, args: DeepSeekV3Args):
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

    def _moe_layers(self) -> list[MoE]:
        return [b.feed_forward for b in self.layers.values() if isinstance(b.feed_forward, MoE)]

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        self.rope_cache = build_rope_cache(self.args, device)
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
                h = block(h, self.rope_cache)
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
        """MLA: the per-head projections (wq or wq_b, wkv_b) split by heads, wo by its input;
        the latent projections and their norms (small, shared by all heads) stay whole on
        every rank, and so does the rotary key, whose gradient (each rank's from its own
        heads) is summed over the ranks (`head_shared`). The dense feed-forward as Llama's, in the dense blocks (`blocks` when
        the others have experts); a MoE layer is split by its own plan, not by this one."""
        query = "attention.wq_b" if self.args.q_lora_rank else "attention.wq"
        block = {
            "attention_norm": "sequence_parallel",
            "attention": "block_input",
            query: "colwise",
            "attention.wkv_b": "colwise",
            "attention.wk_rope": "head_shared",
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
            divisible_by_tp={"n_heads": self.args.n_heads},
        )

    def cp_buffers(self) -> dict[str, int]:
        return {"rope_cache": 0}

    def flops_per_token(self, seq_len: int) -> float:
        return deepseek_v3_flops_per_token(self.args, seq_len)
