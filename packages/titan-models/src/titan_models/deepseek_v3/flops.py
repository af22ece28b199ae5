"""Parameter and FLOP counts of a DeepSeek-V3 model from its `DeepSeekV3Args` alone (the same
on every rank, whatever parallelism did to the module).

FLOPs follow Llama 3's convention (see `titan_models.llama3.flops`): 6 per matmul weight a
token goes through (for a mixture of experts: the router, its top_k experts and the shared
ones; active parameters), plus attention at 6 x seq_len x (qk_head_dim + v_head_dim) per head
and layer (q @ k^T and the weighted sum of values, forward and backward, the full square).
Training FLOPs include the multi-token-prediction layers (`n_mtp_layers`): each runs a block,
its projection `eh_proj` and the output projection once more per token.
"""

from __future__ import annotations

from titan_models.deepseek_v3.args import DeepSeekV3Args


def _attention_params(a: DeepSeekV3Args) -> int:
    q_out = a.n_heads * a.qk_head_dim
    query = a.dim * a.q_lora_rank + a.q_lora_rank * q_out if a.q_lora_rank else a.dim * q_out
    kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim)  # wkv_a and wk_rope
    kv += a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return query + kv + a.n_heads * a.v_head_dim * a.dim


def _attention_norms(a: DeepSeekV3Args) -> int:
    return a.kv_lora_rank + a.q_lora_rank


def _ffn_params(a: DeepSeekV3Args, *, active: bool) -> int:
    """Feed-forward weights of all blocks together."""
    dense = (a.n_layers - a.n_moe_layers) * 3 * a.dim * a.hidden_dim
    if not a.n_moe_layers:
        return dense
    return dense + a.n_moe_layers * a.moe.param_count(a.dim, active=active)


def _mtp_ffn_params(a: DeepSeekV3Args, *, active: bool) -> int:
    """One multi-token-prediction layer's feed-forward: experts when the model has them (its
    index is past the dense blocks), else a dense SwiGLU."""
    if a.is_moe_layer(a.n_layers):
        return a.moe.param_count(a.dim, active=active)
    return 3 * a.dim * a.hidden_dim


def _mtp_matmul_params(a: DeepSeekV3Args, *, active: bool) -> int:
    """One multi-token-prediction layer's matmul weights: its block and `eh_proj`."""
    return _attention_params(a) + _mtp_ffn_params(a, active=active) + 2 * a.dim * a.dim


def deepseek_v3_param_count(args: DeepSeekV3Args, *, active: bool = False, mtp: bool = True) -> int:
    """Total parameters (a tied embedding counted once; the expert-bias buffers are not
    parameters), or with `active` those one token uses (the experts it is not routed to
    left out). With `mtp` (default) the multi-token-prediction layers are counted too: their
    blocks, projections and norms (the embedding and output projection they share are not
    counted twice)."""
    a = args
    per_block = _attention_params(a) + _attention_norms(a) + 2 * a.dim
    embedding = a.vocab_size * a.dim
    output = 0 if a.tie_word_embeddings else a.vocab_size * a.dim
    total = embedding + a.n_layers * per_block + _ffn_params(a, active=active) + a.dim + output
    if mtp:  # per layer: its block's attention, norms and feed-forward, eh_proj, 3 more norms
        per_mtp = _mtp_matmul_params(a, active=active) + _attention_norms(a) + 5 * a.dim
        total += a.n_mtp_layers * per_mtp
    return total


def deepseek_v3_flops_per_token(args: DeepSeekV3Args, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length, over the active
    parameters, the multi-token-prediction layers included."""
    a = args
    matmul = a.n_layers * _attention_params(a) + _ffn_params(a, active=True)
    matmul += a.vocab_size * a.dim  # the output projection
    # Each MTP layer: its block and eh_proj, then the output projection again.
    matmul += a.n_mtp_layers * (_mtp_matmul_params(a, active=True) + a.vocab_size * a.dim)
    blocks = a.n_layers + a.n_mtp_layers
    attention = 6 * blocks * a.n_heads * (a.qk_head_dim + a.v_head_dim) * seq_len
    return float(6 * matmul + attention)
