"""What the shared decoder gives every family alike: the same refusal when cached decoding
runs past the position tables, and `document_ids` in the forward of exactly the families whose
attention takes a block-causal mask (the trainer reads the signature to allow block_causal)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from titan_models import Decoder, KVCache
from titan_models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_spec
from titan_models.gemma3 import gemma3_flavors, gemma3_spec
from titan_models.llama3 import llama3_flavors, llama3_spec
from titan_models.llama4 import llama4_flavors, llama4_spec
from titan_models.qwen3 import qwen3_flavors, qwen3_spec

SMALL = dict(n_layers=2, vocab_size=64, max_seq_len=16)
FAMILIES = {
    "llama3": (llama3_spec, llama3_flavors["debugmodel"], True),
    "qwen3": (qwen3_spec, qwen3_flavors["debugmodel_moe"], True),
    "deepseek_v3": (deepseek_v3_spec, deepseek_v3_flavors["debugmodel"], False),
    "llama4": (llama4_spec, llama4_flavors["debugmodel"], False),
    "gemma3": (gemma3_spec, gemma3_flavors["debugmodel"], True),
}


def _build(name: str) -> Decoder:
    spec, flavor, _ = FAMILIES[name]
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(flavor, **SMALL))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model.eval()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_decoding_past_max_seq_len_is_refused_with_the_limit(name):
    model = _build(name)
    assert isinstance(model, Decoder)
    cache = KVCache(max_len=64)  # room in the cache, none in the position tables
    with torch.no_grad():
        model(torch.zeros(1, 12, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="positions up to 20, but the model has 16"):
            model(torch.zeros(1, 8, dtype=torch.long), kv_cache=cache)
    assert cache.pos == 12  # nothing of the refused call joined the cache


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_document_ids_are_taken_exactly_where_the_attention_has_a_block_causal_mask(name):
    spec, flavor, takes_document_ids = FAMILIES[name]
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(flavor, **SMALL))
    assert ("document_ids" in inspect.signature(model.forward).parameters) == takes_document_ids
