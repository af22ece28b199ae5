"""Parameter and FLOP counts of a Gemma 3 model from its `Gemma3Args` alone (the same on every
rank, whatever parallelism did to the module). The FLOP count follows Llama 3's (see
`titan_models.llama3.flops`): 6 per matmul weight a token goes through, plus attention over
the positions each block sees (a local block at most `sliding_window` of them)."""

from __future__ import annotations

from titan_models.gemma3.args import Gemma3Args


def _matmul_params(args: Gemma3Args) -> int:
    """One block's projections: q, k, v, o and the GeGLU's three."""
    q_and_o = 2 * args.dim * args.n_heads * args.head_dim
    k_and_v = 2 * args.dim * args.n_kv_heads * args.head_dim
    return q_and_o + k_and_v + 3 * args.dim * args.hidden_dim


def gemma3_param_count(args: Gemma3Args) -> int:
    """Total parameters, the tied embedding counted once."""
    norms = 4 * args.dim + 2 * args.head_dim  # the block's four, then q_norm and k_norm
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    return embedding + args.n_layers * (_matmul_params(args) + norms) + args.dim + output


def gemma3_flops_per_token(args: Gemma3Args, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length. Attention counts
    12 * heads * head_dim per key a query sees, taking the causal average as the full
    sequence (as Llama 3's count does) and a local block's keys as at most its window."""
    matmul = args.n_layers * _matmul_params(args) + args.vocab_size * args.dim  # + output
    keys = sum(
        seq_len if args.is_global(i) else min(seq_len, args.sliding_window)
        for i in range(args.n_layers)
    )
    return float(6 * matmul + 12 * args.n_heads * args.head_dim * keys)
