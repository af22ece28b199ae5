"""Parameter and FLOP counts of a Qwen3 model from its `Qwen3Args` alone (the same on every
rank, whatever parallelism did to the module). The FLOP count follows Llama 3's (see
`titan_models.llama3.flops`): 6 per matmul weight a token goes through, plus attention; for
a mixture of experts only the weights a token is *routed through* count: the router, top_k
experts and the shared ones, not all experts (active parameters)."""

from __future__ import annotations

from titan_models.qwen3.args import Qwen3Args


def _attention_params(args: Qwen3Args) -> int:
    q_and_o = 2 * args.dim * args.n_heads * args.head_dim
    k_and_v = 2 * args.dim * args.n_kv_heads * args.head_dim
    return q_and_o + k_and_v


def _ffn_params(args: Qwen3Args, *, active: bool) -> int:
    if args.moe is None:
        return 3 * args.dim * args.hidden_dim
    return args.moe.param_count(args.dim, active=active)


def qwen3_param_count(args: Qwen3Args, *, active: bool = False) -> int:
    """Total parameters (a tied embedding counted once), or with `active` those one token uses
    (every expert it is not routed to left out)."""
    norms = 2 * args.dim + 2 * args.head_dim  # two RMSNorms, then q_norm and k_norm
    block = _attention_params(args) + _ffn_params(args, active=active) + norms
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    return embedding + args.n_layers * block + args.dim + output


def qwen3_flops_per_token(args: Qwen3Args, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length, over the active
    parameters."""
    matmul = args.n_layers * (_attention_params(args) + _ffn_params(args, active=True))
    matmul += args.vocab_size * args.dim  # the output projection
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * matmul + attention)
