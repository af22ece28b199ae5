import dataclasses

import pytest
import torch

from titan_models import LlamaArgs, Transformer, llama3_flavors


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
