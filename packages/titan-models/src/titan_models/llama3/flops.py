"""Parameter and FLOP counts of a Llama 3 model, from its `LlamaArgs` alone.

Counting from the shapes (not from `model.parameters()`) gives the same answer on every rank,
whatever tensor or pipeline parallelism has done to the module.

Training FLOPs per token = 6 * N + 12 * n_layers * n_heads * head_dim * seq_len, where
- N is the number of weights that take part in a matmul: every Linear, including the output
  projection. The embedding lookup and the RMSNorm scales do no matmul and are left out.
  Each matmul weight costs 2 FLOPs per token forward (multiply + add) and 4 backward (gradient
  of the input and of the weight).
- the attention term counts q @ k^T and attn @ v, 2 * seq_len * head_dim FLOPs per query head
  and token each, forward, times 3 for forward + backward. Causal masking is ignored: the full
  square is counted, as `torch.utils.flop_counter.FlopCounterMode` does.
These are model FLOPs, the numerator of MFU. FlopCounterMode also counts the recomputation of
q @ k^T inside a flash-attention backward, so it reports 2 * n_layers * n_heads * head_dim *
seq_len more per token than this (about 2% on the debug model at seq_len 256).
"""

from __future__ import annotations

from titan_models.llama3.args import LlamaArgs


def llama_block_params(args: LlamaArgs) -> int:
    """Parameters of one transformer block (attention, SwiGLU and their two norms)."""
    q_and_o = 2 * args.dim * args.n_heads * args.head_dim
    k_and_v = 2 * args.dim * args.kv_heads * args.head_dim
    ffn = 3 * args.dim * args.ffn_hidden_dim
    return q_and_o + k_and_v + ffn + 2 * args.dim


def llama_param_count(args: LlamaArgs) -> int:
    """Total parameters, counting a tied embedding/output matrix once."""
    embedding = args.vocab_size * args.dim
    output = 0 if args.tie_word_embeddings else args.vocab_size * args.dim
    return embedding + args.n_layers * llama_block_params(args) + args.dim + output


def llama_matmul_params(args: LlamaArgs) -> int:
    """Weights used in matmuls: every Linear of the blocks plus the output projection."""
    per_block = llama_block_params(args) - 2 * args.dim
    return args.n_layers * per_block + args.vocab_size * args.dim


def llama_flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length."""
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * llama_matmul_params(args) + attention)
