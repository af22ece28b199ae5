"""Llama 4 (text): flavors at their published sizes, FLOPs over active parameters, the model
against Hugging Face transformers' Llama4ForCausalLM (logits within 1e-4 in float32, weights
going both ways), its attention scheme against a plain masked reference, and the pieces the
trainer relies on (init by name, meta build, the TP plan naming real modules)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import decode_in_pieces

from titan_models.llama4 import (
    Llama4HFAdapter,
    Llama4Transformer,
    llama4_flavors,
    llama4_flops_per_token,
    llama4_param_count,
    llama4_spec,
    with_moe,
)

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def build(args, seed: int = 0) -> Llama4Transformer:
    with torch.device("meta"):
        model = Llama4Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# Published text-model sizes in billions (the 109B quoted for Scout includes its vision
# encoder), and 17B active for both.
PUBLISHED = {"17bx16e": 107.8, "17bx128e": 400.7}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavors_have_their_published_sizes(flavor):
    args = llama4_flavors[flavor]
    with torch.device("meta"):
        model = Llama4Transformer(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == llama4_param_count(args)
    assert abs(counted / 1e9 - PUBLISHED[flavor]) / PUBLISHED[flavor] < 0.01, counted
    active = llama4_param_count(args, active=True)
    assert abs(active / 1e9 - 17.0) / 17.0 < 0.03, active
    moe_blocks = [i for i, b in model.layers.items() if hasattr(b.feed_forward, "experts")]
    assert len(moe_blocks) == (48 if flavor == "17bx16e" else 24)


def test_flops_per_token_count_the_active_weights_and_the_attended_keys():
    args = llama4_flavors["debugmodel"]
    model = build(args)
    matmul = 0
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings") or p.dim() < 2:
            continue
        share = args.moe.top_k / args.moe.num_experts if ".experts." in name else 1
        matmul += p.numel() * share
    seq = 512  # 8 chunks of 64 in the rotary blocks; block 3 (of 0..5) is global
    keys = 5 * 64 + 1 * 512
    expected = 6 * matmul + 12 * args.n_heads * args.head_dim * keys
    assert model.flops_per_token(seq) == pytest.approx(expected, rel=1e-12)
    # Maverick: 6 x its 16B active matmul weights (17B less the embedding) per token at short
    # sequences, far below 6 x 400B.
    assert 6 * 16e9 < llama4_flops_per_token(llama4_flavors["17bx128e"], 0) < 6 * 16.5e9


def test_init_is_a_function_of_seed_and_name_and_the_tp_plan_names_real_modules():
    args = llama4_flavors["debugmodel"]
    model, again = build(args), build(args)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    named = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert set(model.init_plan()) == named - {"rope_cache", "attn_temperature"} - {
        n
        for n in named
        if n.endswith(("tokens_per_expert", "tokens_rerouted", "router_input_sum"))  # counters
    }
    for flavor in ("debugmodel", "17bx16e"):
        with torch.device("meta"):
            model = Llama4Transformer(dataclasses.replace(llama4_flavors[flavor], n_layers=6))
        plan = model.tp_plan()
        for key, block in model.layers.items():
            names = plan.blocks.get(key, plan.block)
            for name in names:
                block.get_submodule(name)
            assert ("feed_forward.w1" in names) == (not hasattr(block.feed_forward, "experts"))


def _masked_reference(q, k, v, chunk: int | None):
    """Plain attention with an explicit mask: causal, and within chunks when `chunk` is set."""
    seq = q.shape[2]
    pos = torch.arange(seq)
    allowed = pos[None, :] <= pos[:, None]
    if chunk is not None:
        allowed &= (pos[None, :] // chunk) == (pos[:, None] // chunk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def test_chunked_attention_equals_a_masked_reference():
    from titan_models.llama4.model import chunked_causal_attention

    q, k, v = (torch.randn(2, 3, 20, 8) for _ in range(3))
    for chunk in (4, 7, 20, 64):  # whole chunks, a short last chunk, one chunk, longer than seq
        torch.testing.assert_close(
            chunked_causal_attention(q, k, v, chunk), _masked_reference(q, k, v, chunk)
        )
    # Grouped k and v heads (read in place) give what repeating them for each query head gives.
    q = torch.randn(2, 6, 20, 8)
    for chunk in (7, 64):
        torch.testing.assert_close(
            chunked_causal_attention(q, k, v, chunk),
            _masked_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), chunk),
        )


def _small(**changes):
    args = llama4_flavors["debugmodel"]
    moe = dataclasses.replace(args.moe, num_experts=4, hidden_dim=32)
    base = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=300, hidden_dim=96,
                moe=moe, max_seq_len=32, attention_chunk_size=8, floor_scale=4,
                rope_original_max_seq_len=16)  # fmt: skip
    return dataclasses.replace(args, **(base | changes))


def _randomise(model):
    """Non-trivial norm scales (a misplaced norm shows), and queries and keys large enough for
    sharp attention (at init scale attention is nearly uniform, and a missing temperature or
    chunk boundary would hardly change the logits)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("wq.weight", "wk.weight")):
                p.normal_(std=0.3)


CASES = {
    # Scout's scheme: experts in every block, QK-norm, rope scaling, iRoPE, temperature.
    "scout": dict(interleave_moe_layer_step=1, use_qk_norm=True, use_rope_scaling=True),
    # Maverick's: dense and MoE blocks alternate, no QK-norm, no rope scaling.
    "maverick": dict(interleave_moe_layer_step=2, use_qk_norm=False, use_rope_scaling=False),
    # Every block rotary and chunked, no temperature tuning, top-2 routing.
    "all_rope_top2": dict(
        nope_layer_interval=0,
        attn_temperature_tuning=False,
        moe=dataclasses.replace(
            llama4_flavors["debugmodel"].moe, num_experts=4, hidden_dim=32, top_k=2
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_both_ways(tmp_path, case):
    args = _small(**CASES[case])
    model = build(args).eval()  # inference: the debug flavor balances its choice in training
    _randomise(model)
    adapter = Llama4HFAdapter(args, torch_dtype="float32")
    out = tmp_path / "export"
    out.mkdir()
    hf = adapter.to_hf(model.state_dict())
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors"
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Llama4ForCausalLM"
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    export_diff = (ours - theirs).abs().max().item()
    assert export_diff <= 1e-4, export_diff
    assert theirs.abs().max() > 0.1

    saved = tmp_path / "saved"
    hf_model.save_pretrained(saved)
    hf_weights = {}
    for f in saved.glob("*.safetensors"):
        hf_weights |= safetensors_torch.load_file(f)
    reloaded = build(args, seed=123).eval()
    reloaded.load_state_dict(adapter.from_hf(hf_weights))
    with torch.no_grad():
        import_diff = (reloaded(tokens) - theirs).abs().max().item()
    assert import_diff <= 1e-4, import_diff
    print(f"llama4 {case}: export {export_diff:.2e}, import {import_diff:.2e}")


def test_the_attention_scheme_matters_to_the_logits():
    """Each of chunking, the global blocks' missing rotary embedding, their temperature and
    QK-norm changes the output: a model that ignored one would fail the comparisons above."""
    args = _small(interleave_moe_layer_step=1)
    tokens = torch.randint(0, args.vocab_size, (1, args.max_seq_len))
    model = build(args)
    _randomise(model)
    base = model(tokens)
    for change in (dict(attention_chunk_size=32), dict(nope_layer_interval=0),
                   dict(attn_temperature_tuning=False), dict(use_qk_norm=False)):  # fmt: skip
        other = build(dataclasses.replace(args, **change))
        other.load_state_dict(model.state_dict())
        # At least ten times the 1e-4 the comparisons above allow.
        assert (other(tokens) - base).abs().max() > 1e-3, change


def test_import_reads_multimodal_names_and_export_refuses_a_trained_bias():
    args = _small()
    adapter = Llama4HFAdapter(args)
    state = build(args).state_dict()
    hf = adapter.to_hf(state)
    multimodal = {f"language_model.{k}": v for k, v in hf.items()}
    assert adapter.from_hf(multimodal).keys() == adapter.from_hf(hf).keys() == state.keys()
    with pytest.raises(KeyError, match="vision_model"):
        adapter.from_hf(hf | {"vision_model.patch_embedding.linear.weight": torch.zeros(1)})
    state["layers.1.feed_forward.expert_bias"][0] = 0.5
    with pytest.raises(ValueError, match="layer 1 has a non-zero expert bias"):
        adapter.to_hf(state)
    with pytest.raises(ValueError, match="score_before_experts = False"):
        Llama4HFAdapter(with_moe(args, score_before_experts=False)).hf_config()


def test_cached_decoding_gives_the_logits_of_a_full_forward():
    args = _small()
    model = build(args).eval()
    _randomise(model)
    full, cached, cache = decode_in_pieces(
        model, args.vocab_size
    )  # its pieces cross the chunk boundaries at 8 and 16
    # fp32; the cached path attends with an explicit mask instead of is_causal: ~1e-6.
    assert (cached - full).abs().max().item() <= 1e-5
    assert cache.pos == 24


def test_the_family_is_registered_as_llama4():
    from titan_core import plugins, resolve

    assert resolve(plugins.MODELS, "llama4") is llama4_spec
    assert isinstance(llama4_spec.hf_adapter(llama4_flavors["17bx16e"]), Llama4HFAdapter)


def test_readme_flavor_table_lists_every_flavor_with_its_exact_sizes():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Llama 4") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for name, args in llama4_flavors.items():
        row = next(r for r in rows if r.startswith(f"| `{name}` "))
        assert f"{llama4_param_count(args):,}" in row, name
        assert f"{llama4_param_count(args, active=True):,}" in row, name
