import pytest
import torch

from titan_core.protocols import parallelizable_problems
from titan_models import Transformer, llama3_flavors, llama_param_count

# Official Llama 3.1 / 3.2 shapes: (dim, layers, heads, kv heads, intermediate size, tied).
OFFICIAL = {
    "1B": (2048, 16, 32, 8, 8192, True),
    "3B": (3072, 28, 24, 8, 8192, True),
    "8B": (4096, 32, 32, 8, 14336, False),
    "70B": (8192, 80, 64, 8, 28672, False),
    "405B": (16384, 126, 128, 8, 53248, False),
}
# Published sizes, in billions of parameters; the exact counts must round to these.
PUBLISHED = {"1B": 1.24, "3B": 3.21, "8B": 8.03, "70B": 70.6, "405B": 405.9}


def expected_params(dim, layers, heads, kv_heads, hidden, tied, vocab=128256):
    head_dim = dim // heads
    attention = dim * heads * head_dim * 2 + dim * kv_heads * head_dim * 2
    block = attention + 3 * dim * hidden + 2 * dim
    return vocab * dim * (1 if tied else 2) + layers * block + dim


@pytest.mark.parametrize("flavor", list(OFFICIAL))
def test_official_flavor_has_published_shape_and_size(flavor):
    dim, layers, heads, kv_heads, hidden, tied = OFFICIAL[flavor]
    args = llama3_flavors[flavor]
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (dim, layers, heads, kv_heads)
    assert args.ffn_hidden_dim == hidden and args.tie_word_embeddings == tied
    assert args.vocab_size == 128256
    with torch.device("meta"):
        model = Transformer(args)
    n = sum(p.numel() for p in model.parameters())  # a tied matrix is yielded once
    assert n == expected_params(*OFFICIAL[flavor]) == llama_param_count(args)
    assert round(n / 1e9, 2 if n < 1e10 else 1) == PUBLISHED[flavor]
    assert model.layers["0"].feed_forward.w1.weight.shape == (hidden, dim)
    assert model.layers["0"].attention.wk.weight.shape == (kv_heads * dim // heads, dim)
    assert parallelizable_problems(model) == []


def test_small_flavors_sizes():
    debug = llama3_flavors["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.n_heads) == (256, 6, 16)
    bench = llama3_flavors["100M"]
    non_embedding = llama_param_count(bench) - 2 * bench.vocab_size * bench.dim
    assert 90e6 < non_embedding < 110e6


def test_llama_3_1_rope_scaling_is_on_by_default_and_3_2_uses_factor_32():
    assert llama3_flavors["8B"].use_rope_scaling
    assert llama3_flavors["8B"].rope_scaling_factor == 8.0
    assert llama3_flavors["1B"].rope_scaling_factor == 32.0


def test_tp_plan_names_real_modules_and_head_counts():
    args = llama3_flavors["8B"]
    with torch.device("meta"):
        model = Transformer(args)
    plan = model.tp_plan()
    root_modules = dict(model.named_modules())
    block_modules = dict(model.layers["0"].named_modules())
    assert set(plan.root) <= set(root_modules) and set(plan.root) >= {"tok_embeddings", "output"}
    assert set(plan.block) <= set(block_modules)
    linears = {n for n, m in block_modules.items() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(plan.block)  # every block matmul is sharded
    assert dict(plan.divisible_by_tp) == {"n_heads": 32, "n_kv_heads": 8}


def test_bad_shapes_are_rejected_with_the_field_named():
    from titan_models import LlamaArgs

    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaArgs(dim=64, n_heads=4, n_kv_heads=3)
