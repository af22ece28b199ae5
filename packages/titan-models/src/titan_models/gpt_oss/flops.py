"""Parameter and FLOP counts of a GPT-OSS model from its `GptOssArgs` alone (the same on every
rank, whatever parallelism did to the module).

FLOPs follow Llama 3's convention (see `titan_models.llama3.flops`): 6 per matmul weight a
token goes through (the router, its top_k experts: active parameters), plus attention at
12 x head_dim per head, layer and key position it is allowed to see, the full square as the
convention counts it: every earlier position in the full blocks, at most `sliding_window` in
the windowed ones.
"""

from __future__ import annotations

from titan_models.gpt_oss.args import GptOssArgs


def _attention_params(a: GptOssArgs) -> int:
    q_and_o = 2 * a.dim * a.n_heads * a.head_dim
    k_and_v = 2 * a.dim * a.n_kv_heads * a.head_dim
    return q_and_o + k_and_v


def _attention_extras(a: GptOssArgs) -> int:
    """The biases of the four projections and the sinks."""
    return (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.dim + a.n_heads


def gpt_oss_param_count(args: GptOssArgs, *, active: bool = False) -> int:
    """Total parameters (the load-balancing buffers are not parameters), or with `active`
    those one token uses (the experts it is not routed to left out)."""
    a = args
    block = _attention_params(a) + _attention_extras(a) + 2 * a.dim
    block += a.moe.param_count(a.dim, active=active)
    embedding = a.vocab_size * a.dim
    output = 0 if a.tie_word_embeddings else a.vocab_size * a.dim
    return embedding + a.n_layers * block + a.dim + output


def gpt_oss_flops_per_token(args: GptOssArgs, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length, over the active
    parameters."""
    a = args
    matmul = a.n_layers * (_attention_params(a) + a.moe.param_count(a.dim, active=True))
    matmul += a.vocab_size * a.dim  # the output projection
    seen = [
        seq_len if (w := a.attention_window(i)) is None else min(w, seq_len)
        for i in range(a.n_layers)
    ]
    attention = 12 * a.n_heads * a.head_dim * sum(seen)
    return float(6 * matmul + attention)
