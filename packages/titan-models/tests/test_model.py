import copy
import dataclasses
import math

import pytest
import torch
from conftest import build_model

from titan_models import Transformer
from titan_models.llama3.rope import apply_rope, build_rope_cache, build_rope_frequencies


def meta_reference_frequencies(head_dim, theta, factor, low, high, original):
    """Llama 3.1's scaling, one frequency at a time, straight from its definition."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("flavor_args", ["8B", "tiny"])
def test_rope_scaling_matches_the_llama_3_1_formula(flavor_args, tiny_args):
    from titan_models import llama3_flavors

    args = tiny_args if flavor_args == "tiny" else llama3_flavors[flavor_args]
    got = build_rope_frequencies(args).double()
    want = meta_reference_frequencies(
        args.head_dim,
        args.rope_theta,
        args.rope_scaling_factor,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_max_seq_len,
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    unscaled = build_rope_frequencies(dataclasses.replace(args, use_rope_scaling=False)).double()
    # All three regimes occur: kept, divided by the factor, and blended in between.
    kept = torch.isclose(got, unscaled, rtol=1e-6)
    divided = torch.isclose(got, unscaled / args.rope_scaling_factor, rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_rope_rotates_interleaved_pairs_like_meta_complex_reference(tiny_args):
    cache = build_rope_cache(tiny_args)
    assert cache.shape == (tiny_args.max_seq_len, tiny_args.head_dim)
    x = torch.randn(2, 10, 3, tiny_args.head_dim)
    angles = torch.outer(torch.arange(10.0), build_rope_frequencies(tiny_args))
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    want = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotation).flatten(
        -2
    )
    torch.testing.assert_close(apply_rope(x, cache), want, rtol=1e-5, atol=1e-5)


def test_future_tokens_do_not_change_earlier_logits(tiny_args):
    model = build_model(tiny_args)
    tokens = torch.randint(0, tiny_args.vocab_size, (2, 24))
    changed = tokens.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % tiny_args.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 24, tiny_args.vocab_size)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-6)
    assert (a[:, 15:] - b[:, 15:]).abs().max() > 1e-3


def test_rope_table_longer_than_the_sequence_gives_the_same_logits(tiny_args):
    long_model = build_model(tiny_args)
    short_model = build_model(dataclasses.replace(tiny_args, max_seq_len=16))
    short_model.load_state_dict(long_model.state_dict())
    tokens = torch.randint(0, tiny_args.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(long_model(tokens), short_model(tokens), rtol=0, atol=0)


def test_init_is_deterministic_under_a_seed(tiny_args):
    a, b, c = (
        build_model(tiny_args, seed=3),
        build_model(tiny_args, seed=3),
        build_model(tiny_args, seed=4),
    )
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values()
    ):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name


@pytest.mark.parametrize("depth_init", [True, False])
def test_init_follows_the_documented_scheme(depth_init):
    from titan_models import llama3_flavors

    # debugmodel's width (64k draws per wo) with fewer layers and a smaller vocab, to stay fast.
    args = dataclasses.replace(
        llama3_flavors["debugmodel"], n_layers=3, vocab_size=512, depth_init=depth_init
    )
    model = build_model(args)
    # Truncating at 3 sigma shrinks the std by 1.3%; sampling noise on >= 64k draws is < 1%.
    tol = 0.05
    for layer_id, block in model.layers.items():
        depth = int(layer_id) + 1 if depth_init else args.n_layers
        out_std = 0.02 / math.sqrt(2 * depth)
        assert block.attention.wo.weight.std().item() == pytest.approx(out_std, rel=tol)
        assert block.feed_forward.w2.weight.std().item() == pytest.approx(out_std, rel=tol)
        assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=tol)
        assert block.feed_forward.w1.weight.std().item() == pytest.approx(0.02, rel=tol)
        assert block.attention.wq.weight.abs().max() <= 3 * 0.02
        assert torch.equal(block.attention_norm.weight, torch.ones(args.dim))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=tol)
    assert model.output.weight.std().item() == pytest.approx(args.dim**-0.5, rel=tol)
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    torch.testing.assert_close(model.rope_cache, build_rope_cache(args), rtol=0, atol=0)
    assert "rope_cache" not in model.state_dict()


def test_pipeline_stages_with_pre_and_post_blocks_removed_compose_to_the_full_model(tiny_args):
    args = dataclasses.replace(tiny_args, n_layers=4)
    model = build_model(args)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for name in model.post_blocks:
        setattr(first, name, None)
    for name in model.pre_blocks:
        setattr(last, name, None)
    del first.layers["2"], first.layers["3"]
    del last.layers["0"], last.layers["1"]
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 12, args.dim)
        torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=0)
    # Names stay stable, so a stage's checkpoint keys are a subset of the full model's.
    assert set(last.state_dict()) < set(model.state_dict())
    # A stage initialises only what it holds.
    last.init_weights()


def test_tied_embeddings_share_one_parameter_through_to_empty_and_training(tiny_args):
    args = dataclasses.replace(tiny_args, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    torch.manual_seed(0)
    model.init_weights()
    assert model.output.weight.std().item() == pytest.approx(args.dim**-0.5, rel=0.05)
    assert len(list(model.parameters())) == len(model.state_dict()) - 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    model(tokens).sum().backward()
    optimizer.step()
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
