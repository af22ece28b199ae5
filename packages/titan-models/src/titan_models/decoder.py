"""The decoder every model family shares: token embedding -> blocks -> final norm -> output.

A family (Llama 3, Qwen3, DeepSeek-V3, Llama 4) subclasses `Decoder` and gives only what is
its own:
- `attention_class`: its attention, built in each block as `attention_class(layer_id, args)`,
  with class methods `init_plan(args, std, out_std)`, `tp_plan(args)` and
  `divisible_by_tp(args)` (`titan_models.attention.GroupedQueryAttention` is Llama 3's);
- `moe_args(layer_id)`: the blocks whose feed-forward is a mixture of experts
  (`titan_models.moe.MoE`); the others get a SwiGLU of `dense_hidden_dim()`;
- `position_tables(device)`: the tables indexed by position its attention reads (the rotary
  table; Llama 4's attention temperatures), each passed to every block's attention;
- `flops_per_token(seq_len)`.
Everything else is here, once.

Structure: `tok_embeddings` -> `layers` ("0".."n-1", each a `DecoderBlock`: RMSNorm ->
attention -> residual, RMSNorm -> feed-forward -> residual) -> `norm` -> `output`. Nothing is
global: a module's behaviour depends only on the family's args.

Multi-token prediction (`titan_models.mtp`): with `n_mtp_layers` = D > 0 in the family's args,
`layers` also holds D `MTPLayer`s after the main blocks (keys "n".."n+D-1", the decoder's
`head_layers`). In training mode `forward` returns a tuple: the logits, then those of each
depth (depth k at position i predicts the token k + 1 positions after the next one); in eval
mode, and with a KV cache, the logits alone (the layers are not run).

Parallelism hooks: attention reshapes heads with -1 so tensor parallel can shard them
(`tp_plan()`); pipeline parallel may delete blocks from `layers` and set `tok_embeddings`,
`norm` or `output` to None (`pre_blocks`, `post_blocks`), in which case `forward` passes its
input through that step unchanged, and the names of what a stage keeps are the full model's;
it keeps the `head_layers` on the last stage. With MTP in training, what passes between
stages is `[1 + D, batch, seq, dim]`: the hidden states and the embeddings of the tokens ahead,
which the first stage (it holds the embedding) computes for the last.
The position tables are non-persistent buffers with one row per position (dimension 0), so
context parallel cuts them with the sequence (`cp_buffers()`).

Initialisation (`init_weights`, after `to_empty`) is data: `init_plan()` gives each parameter a
`titan_core.ParamInit`, and its values are a function of (seed, parameter name) only, so every
layout (FSDP, TP, pipeline stages) starts from exactly the weights one process draws. Every
draw is truncated at 3 standard deviations except the embedding:
- `tok_embeddings`: normal(0, 1), since the first RMSNorm rescales it anyway.
- what reads a block's input (wq, wk, wv, w1, w3, the router, ...): std 0.02.
- what writes into the residual stream (wo, w2): std 0.02 / sqrt(2 * (layer_id + 1)) with
  `depth_init`, else 0.02 / sqrt(2 * n_layers), so the stream's variance does not grow with depth.
- RMSNorm scales: 1; a mixture of experts' expert bias (a buffer saved with the weights): 0.
- `output`: std dim**-0.5, so initial logits have unit scale. With tied embeddings the shared
  matrix gets this init (normal(0, 1) would make the logits sqrt(dim) times too large).
- an MTP layer: its block like block n + k, its norms 1, `eh_proj` std 0.02.
On DTensor parameters each rank draws only the blocks of its own shard (see titan_core.init).

Where new features hang: `head(h, ...)` is every step after the blocks (the final norm, the
output projection, the MTP layers); a feature that replaces the output projection (a fused
linear + cross-entropy) overrides `head`. `moe_layers()` lists the mixture-of-experts layers
the module holds (load balancing). A family whose attention takes no block-causal mask
overrides `forward` without `document_ids`, and its `ModelSpec.features` say so, so that the
trainer refuses block_causal for it; `block_causal_impl` (from the args, an attribute a caller
may change) picks how the mask of a forward with `document_ids` runs. `sdpa_heads()` and
`set_sdpa_backend()` are the SDPA kernel choice of a family whose attention takes one (a
`TakesSDPAKernel`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPPlan
from titan_models.args import DecoderArgs
from titan_models.attention import GroupedQueryAttention
from titan_models.attention_backend import SDPAChoice, TakesSDPAKernel, set_attention_backend
from titan_models.block_causal import BlockCausalImpl, build_attention_mask
from titan_models.decoder_block import DecoderBlock
from titan_models.generation import KVCache
from titan_models.moe import MoE, MoEArgs, SwiGLU, moe_init_plan, swiglu_init_plan
from titan_models.mtp import MTP_TP_PLAN, MTPLayer, mtp_init_plan, tokens_ahead
from titan_models.weights import init_by_plan_

BASE_STD = 0.02
_ONE = ParamInit("constant", value=1.0)
_ROOT_TP_PLAN = {"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "output"}
_DENSE_FFN_TP_PLAN = {
    "feed_forward": "block_input",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}


def block_init_plan(
    layer_id: int, args: DecoderArgs, attention: type[nn.Module], moe: MoEArgs | None
) -> dict[str, ParamInit]:
    """How block `layer_id`'s parameters start, by name relative to the block, for a family's
    `attention` class and the block's experts `moe` (None: a dense SwiGLU)."""
    depth = layer_id + 1 if args.depth_init else args.n_layers
    std, out_std = BASE_STD, BASE_STD / math.sqrt(2 * depth)  # wo, w2 write into the residual
    plan = {"attention_norm.weight": _ONE, "ffn_norm.weight": _ONE}
    plan |= {f"attention.{n}": p for n, p in attention.init_plan(args, std, out_std).items()}
    if moe is None:
        ffn = swiglu_init_plan(std, out_std)
    else:  # the expert bias (and router center) are buffers, but state (saved with the
        # weights): zero at first
        ffn = moe_init_plan(moe, std, out_std) | {"expert_bias": ParamInit("constant", value=0.0)}
        if moe.router_centering:
            ffn["router_center"] = ParamInit("constant", value=0.0)
    return plan | {f"feed_forward.{n}": p for n, p in ffn.items()}


class Decoder(nn.Module):
    """A decoder-only language model; satisfies `titan_core.TrainableModel` (and so
    `ParallelizableModel`).

    Build under `torch.device("meta")`, then `to_empty(device=...)` and `init_weights()`.
    `forward(tokens)` maps int64 `[batch, seq]` tokens to `[batch, seq, vocab]` logits. With
    `tok_embeddings` set to None it takes hidden states `[batch, seq, dim]` instead, and with
    `norm`/`output` set to None it returns hidden states (pipeline stages).
    """

    pre_blocks = ("tok_embeddings",)
    post_blocks = ("norm", "output")
    attention_class: type[nn.Module] = GroupedQueryAttention

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.block_causal_impl: BlockCausalImpl = args.block_causal_impl
        """How the block-causal mask of a forward with `document_ids` is computed (`auto`,
        `dense`, `flex`, `varlen`; see `titan_models.block_causal`): the args', a plain
        attribute that may be changed after building."""
        self.mtp_depth: int = args.n_mtp_layers
        """Multi-token-prediction layers (0: none)."""
        n = args.n_layers
        self.head_layers = tuple(str(i) for i in range(n, n + self.mtp_depth))
        """The keys of `layers` that run after the final norm (the MTP layers)."""
        # Named in post_blocks, pipeline parallel keeps them on the last stage with the output.
        self.post_blocks = ("norm", "output", *(f"layers.{k}" for k in self.head_layers))
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): self.build_block(i) for i in range(n + self.mtp_depth)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self._tie_weights()
        tables = self.position_tables()
        self.table_names = tuple(tables)
        for name, table in tables.items():  # functions of args: never checkpointed
            self.register_buffer(name, table, persistent=False)

    # What a family gives (see the module docstring).

    def position_tables(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """The tables indexed by position (dimension 0) the attention reads, by buffer name."""
        raise NotImplementedError(f"{type(self).__name__} does not define position_tables()")

    def moe_args(self, layer_id: int) -> MoEArgs | None:
        """Block `layer_id`'s experts; None (every block, unless a family says otherwise): a
        dense SwiGLU."""
        return None

    def dense_hidden_dim(self) -> int:
        """The hidden size of the dense blocks' SwiGLU."""
        return self.args.hidden_dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at this sequence length."""
        raise NotImplementedError(f"{type(self).__name__} does not define flops_per_token()")

    # The shared decoder.

    def build_block(self, layer_id: int) -> nn.Module:
        """Block `layer_id`: a `DecoderBlock`, or an `MTPLayer` from n_layers on."""
        moe = self.moe_args(layer_id)
        attention = self.attention_class(layer_id, self.args)
        dim = self.args.dim
        ffn = SwiGLU(dim, self.dense_hidden_dim()) if moe is None else MoE(dim, moe)
        block = MTPLayer if layer_id >= self.args.n_layers else DecoderBlock
        return block(dim, self.args.norm_eps, attention, ffn)

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

    def block_init_plan(self, layer_id: int) -> dict[str, ParamInit]:
        """How block `layer_id`'s parameters start, by name relative to the block."""
        plan = block_init_plan(layer_id, self.args, self.attention_class, self.moe_args(layer_id))
        if layer_id >= self.args.n_layers:  # an MTP layer
            plan |= mtp_init_plan(BASE_STD)
        return plan

    def init_plan(self) -> dict[str, ParamInit]:
        """How every parameter of the full model starts, by fully qualified name (see the
        module docstring). Names of blocks a pipeline stage does not hold are included."""
        plan: dict[str, ParamInit] = {}
        # Built from the args, not from self.layers, so a stage knows every block's rule.
        for i in range(self.args.n_layers + self.mtp_depth):
            plan |= {f"layers.{i}.{n}": p for n, p in self.block_init_plan(i).items()}
        plan["norm.weight"] = _ONE
        if self.args.tie_word_embeddings:
            # One matrix, one draw, whichever end of a pipeline holds it.
            shared = ParamInit.truncated(self.args.dim**-0.5, key="output.weight")
            plan["tok_embeddings.weight"] = plan["output.weight"] = shared
        else:
            plan["tok_embeddings.weight"] = ParamInit("normal", std=1.0)
            plan["output.weight"] = ParamInit.truncated(self.args.dim**-0.5)
        return plan

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts feed-forwards of the blocks this module holds."""
        return [m for m in self.layers.modules() if isinstance(m, MoE)]

    def sdpa_heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size) of the attention whose SDPA kernel
        `set_sdpa_backend` chooses, before tensor parallel splits the heads."""
        if not issubclass(self.attention_class, TakesSDPAKernel):
            raise NotImplementedError(
                f"{type(self).__name__}'s attention ({self.attention_class.__name__}) takes no"
                " SDPA kernel choice"
            )
        return self.attention_class.sdpa_heads(self.args)

    def set_sdpa_backend(self, choice: SDPAChoice | None) -> int:
        """Run causal attention on `choice` (None: torch's dispatch); how many layers took it."""
        return set_attention_backend(self, choice)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recompute the position tables on `buffer_device` (default: where they are) and
        reset the experts' load counts; the expert biases (state) keep their values."""
        device = buffer_device
        if device is None and self.table_names:
            device = getattr(self, self.table_names[0]).device
        for name, table in self.position_tables(device).items():
            setattr(self, name, table)
        for moe in self.moe_layers():
            moe.init_buffers(device)

    def init_weights(
        self, buffer_device: torch.device | None = None, *, seed: int | None = None
    ) -> None:
        """Give every parameter and buffer its initial value (see the module docstring).

        `seed` defaults to torch's current seed (`torch.manual_seed(s)` then `init_weights()`
        uses s). Works on plain and on sharded (DTensor) parameters alike, and on a pipeline
        stage holding only some blocks. `buffer_device` is where the position tables are
        computed; by default where they already are.
        """
        self.init_buffers(buffer_device)
        init_by_plan_(self, seed)

    def forward(
        self,
        tokens: torch.Tensor,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Logits of every position of `tokens` (in training with MTP, a tuple: these, then
        each depth's). With `kv_cache` (generation, see `titan_models.generation`) the tokens
        continue the positions the cache holds, and their keys and values join it. With
        `document_ids` (`[batch, seq]`, see `titan_models.attention`) a position attends only
        within its own document."""
        predicting = self.mtp_depth if self.training and kv_cache is None else 0
        h, ahead = self._embed(tokens, predicting)
        if kv_cache is not None:
            return self.head(self._continue(h, kv_cache))
        # The first stage's tokens, not h: sequence parallel leaves h a shard of the sequence.
        mask = self.attention_mask(tokens if self.tok_embeddings is not None else h, document_ids)
        inputs = {} if mask is None else {"mask": mask}
        tables = [getattr(self, name) for name in self.table_names]
        for key, block in self.layers.items():
            if key not in self.head_layers:
                h = block(h, *tables, **inputs)
        return self.head(h, ahead, tables, inputs)

    def attention_mask(self, h: torch.Tensor, document_ids: torch.Tensor | None):
        """The forward's `AttentionMask`, shared by every block: block-causal over
        `document_ids`, with a FlexAttention mask per sliding window the blocks use. A model
        with sliding windows or sinks gets one without document ids too (one document per
        row of `h`, `[batch, seq, ...]`: the tokens or the hidden states), so that every layer
        attends through one mask implementation; None: causal."""
        args = self.args
        if document_ids is None and (args.attention_windows() or args.attention_sinks):
            document_ids = torch.zeros(h.shape[:2], dtype=torch.long, device=h.device)
        return build_attention_mask(
            document_ids, impl=self.block_causal_impl, windows=args.attention_windows()
        )

    def _embed(
        self, tokens: torch.Tensor, predicting: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden states the blocks start from, and with MTP the embeddings of the tokens
        ahead (from the embedding, or from what an earlier pipeline stage passed on)."""
        if self.tok_embeddings is None:  # a later pipeline stage
            if not predicting:
                return tokens, []
            h, *ahead = tokens.unbind(0)
            return h, ahead
        if not predicting:
            return self.tok_embeddings(tokens), []
        # One lookup for all (FSDP gathers the table once): the tokens, then those ahead.
        embedded = self.tok_embeddings(torch.cat([tokens, tokens_ahead(tokens, predicting)]))
        h, *ahead = embedded.split(tokens.shape[0])
        return h, ahead

    def _continue(self, h: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """The blocks on hidden states at the positions after those `kv_cache` holds."""
        start, seq_len = kv_cache.pos, h.shape[1]
        kv_cache.check_room(seq_len)
        if start + seq_len > self.args.max_seq_len:
            raise ValueError(
                f"positions up to {start + seq_len}, but the model has {self.args.max_seq_len}"
                " (its max_seq_len)"
            )
        rows = [getattr(self, name)[start : start + seq_len] for name in self.table_names]
        for name, block in self.layers.items():
            if name not in self.head_layers:
                h = block(h, *rows, kv_cache=kv_cache.layer(name), start=start)
        kv_cache.pos += seq_len
        return h

    def head(
        self,
        h: torch.Tensor,
        ahead: list[torch.Tensor] | None = None,
        tables: list[torch.Tensor] | None = None,
        inputs: dict | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Every step after the blocks: the final norm, then the output projection (either
        None on a pipeline stage that does not end the model). With `ahead` (MTP in
        training: the embeddings of the tokens each depth reads), the MTP layers after them
        on the blocks' `tables` and attention `inputs`, each through the same output
        projection; a stage before the last passes `ahead` on under the hidden states."""
        ahead = ahead or []
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return torch.stack([h, *ahead]) if ahead else h
        logits = self.output(h)
        if not ahead:
            return logits
        outputs = [logits]
        for key, embedded in zip(self.head_layers, ahead, strict=True):
            h = self.layers[key](h, embedded, *(tables or []), **(inputs or {}))
            outputs.append(self.output(h))
        return tuple(outputs)

    def tp_plan(self) -> TPPlan:
        """Attention as its class says (by heads); the dense feed-forward split in the dense
        blocks (`blocks` when others have experts). A mixture-of-experts layer is split by its
        own plan (`MoE.moe_plan()`, which titan-parallel reads under TP and EP), not by this
        one."""
        attention = self.attention_class.tp_plan(self.args)
        block = {"attention_norm": "sequence_parallel", "attention": "block_input"}
        block |= {f"attention.{n}": style for n, style in attention.items()}
        block["ffn_norm"] = "sequence_parallel"
        dense = block | _DENSE_FFN_TP_PLAN
        n_layers = self.args.n_layers + self.mtp_depth
        moe_blocks = {i for i in range(n_layers) if self.moe_args(i) is not None}
        blocks = {str(i): dense for i in range(n_layers) if moe_blocks and i not in moe_blocks}
        for key in self.head_layers:  # an MTP layer: its block, and its own modules
            blocks[key] = blocks.get(key, block if moe_blocks else dense) | MTP_TP_PLAN
        return TPPlan(
            root=dict(_ROOT_TP_PLAN),
            block=block if moe_blocks else dense,
            blocks=blocks,
            divisible_by_tp=self.attention_class.divisible_by_tp(self.args),
        )

    def cp_buffers(self) -> dict[str, int]:
        if self.mtp_depth:  # a rank's shard lacks the tokens ahead at its end
            raise ValueError(
                f"multi-token prediction (n_mtp_layers = {self.mtp_depth}) reads the tokens up"
                f" to {self.mtp_depth} positions ahead, which context parallel puts on other"
                " ranks\ntrain with n_mtp_layers = 0, or without context parallel"
            )
        return dict.fromkeys(self.table_names, 0)  # one row per position
