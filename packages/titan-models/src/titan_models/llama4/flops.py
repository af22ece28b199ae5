"""Parameter and FLOP counts of a Llama 4 model from its `Llama4Args` alone (the same on every
rank, whatever parallelism did to the module).

FLOPs follow Llama 3's convention (see `titan_models.llama3.flops`): 6 per matmul weight a
token goes through (in a mixture-of-experts block: the router, its top_k experts and the
shared one; active parameters), plus attention at 12 x head_dim x (keys per query) per head
and block, the full square of what is computed: the whole sequence in the global blocks, one
chunk (at most `attention_chunk_size` positions) in the rotary blocks.
"""

from __future__ import annotations

from titan_models.llama4.args import Llama4Args


def _attention_params(a: Llama4Args) -> int:
    return 2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.n_kv_heads * a.head_dim


def _ffn_params(a: Llama4Args, *, active: bool) -> int:
    """Feed-forward weights of all blocks together."""
    moe = a.n_moe_layers
    dense = (a.n_layers - moe) * 3 * a.dim * a.hidden_dim
    return dense + (moe * a.moe.param_count(a.dim, active=active) if moe else 0)


def llama4_param_count(args: Llama4Args, *, active: bool = False) -> int:
    """Total parameters (a tied embedding counted once), or with `active` those one token uses
    (the experts it is not routed to left out)."""
    a = args
    embedding = a.vocab_size * a.dim
    output = 0 if a.tie_word_embeddings else a.vocab_size * a.dim
    blocks = a.n_layers * (_attention_params(a) + 2 * a.dim) + _ffn_params(a, active=active)
    return embedding + blocks + a.dim + output


def llama4_flops_per_token(args: Llama4Args, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length, over the active
    parameters."""
    a = args
    matmul = a.n_layers * _attention_params(a) + _ffn_params(a, active=True)
    matmul += a.vocab_size * a.dim  # the output projection
    keys = sum(
        min(seq_len, a.attention_chunk_size) if a.uses_rope(i) else seq_len
        for i in range(a.n_layers)
    )
    return float(6 * matmul + 12 * a.n_heads * a.head_dim * keys)
