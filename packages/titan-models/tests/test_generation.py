"""Generation with a KV cache: cached decoding computes what a full forward computes, greedy
tokens are those of `transformers`' greedy generation for the same weights, and sampling draws
only from what temperature, top-k and top-p leave."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_model, decode_in_pieces

from titan_models import LlamaHFAdapter, Sampling, generate, next_token


def test_cached_decoding_gives_the_logits_of_a_full_forward(tiny_args):
    model = build_model(tiny_args).eval()
    full, cached, cache = decode_in_pieces(model, tiny_args.vocab_size)
    assert cache.pos == 24
    # fp32; the cached path attends with an explicit mask instead of is_causal: ~1e-6.
    assert (cached - full).abs().max().item() <= 1e-5
    tokens = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="holds 24 positions; 24 are used and 1 more"):
        model(tokens, kv_cache=cache)


def test_greedy_tokens_equal_transformers_greedy_generation(tiny_args):
    transformers = pytest.importorskip("transformers", reason="the test extra installs it")
    args = dataclasses.replace(tiny_args, max_seq_len=64)
    model = build_model(args, seed=3).eval()
    adapter = LlamaHFAdapter(args, torch_dtype="float32")
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**adapter.hf_config()))
    hf_model.load_state_dict(adapter.to_hf(model.state_dict()))
    hf_model.eval()
    prompt = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    ours = generate(model, prompt, 40)
    with torch.no_grad():
        theirs = hf_model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
            min_new_tokens=40, pad_token_id=0, eos_token_id=None,
        )[:, 8:]  # fmt: skip
    assert theirs.shape == (2, 40)
    assert torch.equal(ours, theirs), (ours, theirs)
    assert len(set(ours.flatten().tolist())) > 5  # not one token repeated


def test_sampling_draws_only_what_top_k_and_top_p_leave():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)

    def drawn(**kw) -> torch.Tensor:
        return torch.bincount(next_token(logits, Sampling(**kw), gen), minlength=4)

    assert next_token(logits[:1], Sampling()).item() == 1  # greedy
    assert drawn(temperature=1.0, top_k=1).tolist() == [0, 4000, 0, 0]
    # top_p 0.8: 0.5 + 0.3 reach it, so the 0.15 and 0.05 tokens go
    counts = drawn(temperature=1.0, top_p=0.8)
    assert counts[0] == counts[2] == 0
    # renormalised 0.5 : 0.3 -> 0.625; 4000 draws: 3 standard deviations are 0.023
    assert abs(counts[1] / 4000 - 0.625) < 0.023
    counts = drawn(temperature=1.0, top_k=3)
    assert counts[0] == 0 and counts[2] > 0
    # temperature 1 without filters: the model's own probabilities (3 sd of 4000 draws)
    counts = drawn(temperature=1.0)
    for token, p in enumerate([0.05, 0.5, 0.15, 0.3]):
        assert abs(counts[token] / 4000 - p) < 3 * (p * (1 - p) / 4000) ** 0.5, (token, counts)
    with pytest.raises(ValueError, match="top_p = 1.5"):
        Sampling(top_p=1.5).validate()


def test_generation_stops_at_a_stop_token_and_keeps_padded_ids_out(tiny_args):
    model = build_model(tiny_args).eval()
    prompt = torch.randint(
        0, tiny_args.vocab_size, (1, 4), generator=torch.Generator().manual_seed(5)
    )
    free = generate(model, prompt, 12)
    first = free[0, 3].item()
    stopped = generate(model, prompt, 12, stop_tokens={first})
    assert stopped[0].tolist() == free[0, : stopped.shape[1]].tolist()
    assert stopped[0, -1].item() == first and first not in stopped[0, :-1].tolist()
    limited = generate(model, prompt, 30, Sampling(temperature=2.0), vocab_limit=10,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert limited.max().item() < 10
