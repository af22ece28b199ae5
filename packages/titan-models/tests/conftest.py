import dataclasses

import pytest
import torch

from titan_models import KVCache, LlamaArgs, Transformer, llama3_flavors


def build_model(args: LlamaArgs, seed: int = 0) -> Transformer:
    """The documented recipe: build on meta, materialise on CPU, init under a seed."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.fixture(scope="session")
def tiny_args() -> LlamaArgs:
    """Two layers, GQA 2:1, head_dim 16, rope scaling bands all reached within 64 positions."""
    return dataclasses.replace(
        llama3_flavors["debugmodel"],
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=97,
        max_seq_len=64,
        rope_theta=10000.0,
        rope_original_max_seq_len=32,
    )


def decode_in_pieces(model, vocab_size: int):
    """A full forward of 2 x 24 tokens, and the same tokens through a KV cache: a prompt of 10,
    a piece of 4 (its queries see the cache and each other causally), then one token at a
    time. Returns (full logits, cached logits, the cache)."""
    tokens = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_len=24)
        parts = [model(tokens[:, :10], kv_cache=cache), model(tokens[:, 10:14], kv_cache=cache)]
        parts += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(14, 24)]
    return full, torch.cat(parts, dim=1), cache
