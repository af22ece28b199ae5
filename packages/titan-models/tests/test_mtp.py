"""Multi-token prediction on the shared decoder (`titan_models.mtp`), on a small DeepSeek-V3
with two MTP layers: what each depth computes (against the formula, written out from the
model's own modules), that depth k at position i sees no token past i + k, that inference
drops the layers, and that the pipeline stages' hand-over (hidden states stacked with the
embeddings ahead) gives the whole model's outputs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titan_models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_flavors
from titan_models.moe import TopKRouter
from titan_models.mtp import tokens_ahead

SEQ = 12


@pytest.fixture(scope="module")
def model() -> DeepSeekV3Transformer:
    base = deepseek_v3_flavors["debugmodel"]
    args = dataclasses.replace(
        base, dim=32, n_layers=2, n_dense_layers=1, n_heads=2, vocab_size=50, hidden_dim=48,
        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_seq_len=SEQ, moe=dataclasses.replace(base.moe, hidden_dim=16), n_mtp_layers=2,
    )  # fmt: skip
    with torch.device("meta"):
        m = DeepSeekV3Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(seed=3)
    with torch.no_grad():  # norms away from 1: a swapped enorm/hnorm shows
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def tokens() -> torch.Tensor:
    return torch.randint(0, 50, (2, SEQ), generator=torch.Generator().manual_seed(0))


def test_each_depth_is_the_papers_formula_with_the_embedding_first(model):
    t = tokens()
    model.train()
    with torch.no_grad():
        outputs = model(t)
        assert len(outputs) == 3 and all(o.shape == (2, SEQ, 50) for o in outputs)
        h = model.tok_embeddings(t)
        for key in ("0", "1"):
            h = model.layers[key](h, model.rope_cache)
        h = model.norm(h)  # h^0: what the main output head reads
        assert torch.equal(outputs[0], model.output(h))
        for k, key in enumerate(model.head_layers, start=1):
            layer = model.layers[key]
            ahead = model.tok_embeddings(F.pad(t[:, k:], (0, k)))  # t_{i+k}, 0 past the end
            x = layer.eh_proj(torch.cat([layer.enorm(ahead), layer.hnorm(h)], dim=-1))
            h = x + layer.attention(layer.attention_norm(x), model.rope_cache)
            h = layer.norm(h + layer.feed_forward(layer.ffn_norm(h)))
            torch.testing.assert_close(outputs[k], model.output(h), rtol=0, atol=1e-6)


def test_depth_k_at_position_i_sees_no_token_after_i_plus_k(model):
    t = tokens()
    model.train()
    with torch.no_grad():
        base = model(t)
        j = 7
        changed = t.clone()
        changed[:, j] = (changed[:, j] + 1) % 50
        other = model(changed)
    for k, (a, b) in enumerate(zip(base, other)):
        # Per position; when a token's routing changes, the experts' matmuls take other
        # shapes, which moves the other positions by rounding only (~1e-7).
        differs = (a - b).abs().amax(dim=(0, 2)) > 1e-4
        # Position i reads tokens up to i + k (k = 0: the main head), so token j first
        # reaches position j - k.
        assert not differs[: j - k].any(), (k, differs)
        assert differs[j - k], (k, differs)


def test_inference_drops_the_mtp_layers(model):
    # Routed alike in training and inference: without the debug flavor's training-only
    # expert capacity (inference never limits).
    plain = copy.deepcopy(model)
    for router in (m for m in plain.modules() if isinstance(m, TopKRouter)):
        router.args = dataclasses.replace(router.args, capacity_factor=None)
    t = tokens()
    with torch.no_grad():
        trained = plain.train()(t)
        inferred = plain.eval()(t)
    assert isinstance(inferred, torch.Tensor) and torch.equal(inferred, trained[0])


def test_pipeline_stages_hand_the_embeddings_ahead_to_the_last_stage(model):
    """The stages as pipeline parallel cuts them (titan_parallel.build_stage_modules: blocks
    deleted, the pre- and post-block modules set to None, the head layers on the last stage)."""
    t = tokens()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for key in list(first.layers):
        if key != "0":
            del first.layers[key]
    del last.layers["0"]
    first.norm = first.output = None
    last.tok_embeddings = None
    model.train()
    with torch.no_grad():
        passed = first(t)
        assert passed.shape == (1 + model.mtp_depth, 2, SEQ, 32)
        staged = last(passed)
        whole = model(t)
    for a, b in zip(staged, whole, strict=True):
        assert torch.equal(a, b)


def test_tokens_ahead_moves_left_and_pads_with_zero():
    t = torch.tensor([[5, 6, 7, 8]])
    assert tokens_ahead(t, 2).tolist() == [[6, 7, 8, 0], [7, 8, 0, 0]]
    assert tokens_ahead(t, 5)[-1].tolist() == [0, 0, 0, 0]
