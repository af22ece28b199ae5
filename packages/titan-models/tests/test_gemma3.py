"""Gemma 3 (text): flavors at the sizes of transformers' Gemma3ForCausalLM built from the Hub
configs, the model against that class (logits within 1e-4 in float32, eager attention,
weights going both ways through the Hub's file layout), and the pieces the trainer relies on
(tied embeddings, init by name, registration)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from titan_models.gemma3 import (
    Gemma3Args,
    Gemma3HFAdapter,
    Gemma3Transformer,
    gemma3_flavors,
    gemma3_flops_per_token,
    gemma3_param_count,
    gemma3_spec,
)

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def build(args, seed: int = 0) -> Gemma3Transformer:
    with torch.device("meta"):
        model = Gemma3Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def hf_config(args: Gemma3Args):
    """transformers' config of a model of ours, as its `config.json` would load."""
    return transformers.Gemma3TextConfig(**Gemma3HFAdapter(args, torch_dtype="float32").hf_config())


# Text parameters, in billions, of the published models (Google's model cards: 1B; the 4B,
# 12B and 27B totals less their ~0.4B SigLIP vision encoder).
PUBLISHED = {"1B": 1.0, "4B": 3.88, "12B": 11.77, "27B": 27.0}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavors_have_the_sizes_of_transformers_models(flavor):
    args = gemma3_flavors[flavor]
    with torch.device("meta"):
        ours = Gemma3Transformer(args)
        theirs = transformers.Gemma3ForCausalLM(hf_config(args))
    counted = sum(p.numel() for p in ours.parameters())  # the tied matrix once
    print(f"{flavor}: {counted:,} parameters")
    assert counted == gemma3_param_count(args)
    assert counted == sum(p.numel() for p in theirs.parameters())
    assert abs(counted / 1e9 - PUBLISHED[flavor]) / PUBLISHED[flavor] < 0.02, counted


def test_hub_values_of_the_flavors():
    # From google/gemma-3-{1b,4b,12b,27b}-pt config.json (text_config), transformers'
    # Gemma3TextConfig defaults filling what they leave out.
    expected = {  # dim, layers, heads, kv heads, head_dim, hidden, window, q scalar, scaling
        "1B": (1152, 26, 4, 1, 256, 6912, 512, 256, 1.0),
        "4B": (2560, 34, 8, 4, 256, 10240, 1024, 256, 8.0),
        "12B": (3840, 48, 16, 8, 256, 15360, 1024, 256, 8.0),
        "27B": (5376, 62, 32, 16, 128, 21504, 1024, 168, 8.0),
    }
    for name, shape in expected.items():
        a = gemma3_flavors[name]
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.hidden_dim,
                a.sliding_window, a.query_pre_attn_scalar, a.rope_scaling_factor) == shape  # fmt: skip
        assert (a.rope_theta, a.rope_local_theta, a.norm_eps) == (1e6, 1e4, 1e-6)
        assert a.tie_word_embeddings
        assert a.vocab_size == (262144 if name == "1B" else 262208)
        windows = [a.attention_window(i) for i in range(12)]
        assert windows == [a.sliding_window] * 5 + [None] + [a.sliding_window] * 5 + [None]
        assert hf_config(a).layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]


def test_local_blocks_cost_fewer_flops_than_global_ones():
    args = gemma3_flavors["27B"]
    long, short = gemma3_flops_per_token(args, 32768), gemma3_flops_per_token(args, 1024)
    global_attention = 12 * args.n_heads * args.head_dim * (32768 - 1024)
    assert long - short == pytest.approx(global_attention * len(range(5, 62, 6)))


def test_debug_flavor_ties_the_embedding_and_inits_by_name():
    model = build(gemma3_flavors["debugmodel"])
    assert model.output.weight is model.tok_embeddings.weight
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.zeros_like(p)), name  # a (1 + w) scale of 1
    again = build(gemma3_flavors["debugmodel"])
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name  # init is a function of (seed, name)


def _tiny(window: int, seq: int = 32) -> Gemma3Args:
    # Blocks 1 and 3 global; a query scalar that is not head_dim; linear rope scaling.
    return dataclasses.replace(
        gemma3_flavors["debugmodel"], n_layers=4, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
        hidden_dim=96, vocab_size=300, max_seq_len=seq, query_pre_attn_scalar=24,
        sliding_window=window, global_every=2, rope_scaling_factor=8.0, rope_theta=1000.0,
    )  # fmt: skip


def _randomise_norms(model):
    with torch.no_grad():  # non-zero norm weights, so that a misplaced norm or (1 + w) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)


def _exported(tmp_path: Path, model: Gemma3Transformer, adapter: Gemma3HFAdapter):
    out = tmp_path / "export"
    out.mkdir()
    hf = adapter.to_hf(model.state_dict())
    assert "lm_head.weight" not in hf  # tied: embed_tokens only, as the Hub's files
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors"
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    return transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()


# Window 32: the whole sequence (local and global blocks agree); 8: a quarter of it.
@pytest.mark.parametrize("window", [32, 8])
def test_logits_match_transformers_both_ways(tmp_path, window):
    args = _tiny(window)
    model = build(args).eval()
    _randomise_norms(model)
    adapter = Gemma3HFAdapter(args, torch_dtype="float32")
    hf_model = _exported(tmp_path, model, adapter)
    assert type(hf_model).__name__ == "Gemma3ForCausalLM"
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    print(f"window {window}: max |logit difference| {(ours - theirs).abs().max():.2e}")
    assert (ours - theirs).abs().max().item() <= 1e-4, (ours - theirs).abs().max()
    assert theirs.abs().max() > 0.1

    # Import: the checkpoint transformers writes, into a differently seeded model of ours.
    saved = tmp_path / "saved"
    hf_model.save_pretrained(saved)
    hf_weights = {}
    for f in saved.glob("*.safetensors"):
        hf_weights |= safetensors_torch.load_file(f)
    reloaded = build(args, seed=123).eval()
    reloaded.load_state_dict(adapter.from_hf(hf_weights))
    with torch.no_grad():
        assert (reloaded(tokens) - theirs).abs().max().item() <= 1e-4


def test_state_dict_of_a_transformers_model_loads_with_the_same_logits():
    args = _tiny(window=32)
    torch.manual_seed(3)
    hf_model = transformers.Gemma3ForCausalLM(hf_config(args)).eval()
    hf_model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:  # transformers starts them at 0
                p.uniform_(-0.5, 0.5)
    adapter = Gemma3HFAdapter(args)
    ours = build(args, seed=9).eval()
    ours.load_state_dict(adapter.from_hf(hf_model.state_dict()))
    tokens = torch.randint(0, args.vocab_size, (3, args.max_seq_len))
    with torch.no_grad():
        diff = (ours(tokens) - hf_model(input_ids=tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # And back: the same tensors under the same names.
    exported = adapter.to_hf(ours.state_dict())
    theirs = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert exported.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(exported[name], tensor), name


def test_the_sliding_window_changes_the_logits_and_decodes_with_a_cache_as_a_full_forward():
    from conftest import decode_in_pieces

    args = _tiny(window=8)
    model = build(args).eval()
    _randomise_norms(model)
    whole = build(dataclasses.replace(args, sliding_window=32)).eval()
    whole.load_state_dict(model.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.no_grad():
        ours, unwindowed = model(tokens), whole(tokens)
    # The first 8 positions see the same keys; later ones in the local blocks fewer.
    assert (ours[:, :8] - unwindowed[:, :8]).abs().max().item() <= 1e-5
    assert (ours[:, 8:] - unwindowed[:, 8:]).abs().max().item() > 1e-2
    full, cached, _ = decode_in_pieces(model, args.vocab_size)
    assert (cached - full).abs().max().item() <= 1e-5  # fp32, as the other families' test


def test_the_family_is_registered_as_gemma3():
    from titan_core import plugins, resolve

    assert resolve(plugins.MODELS, "gemma3") is gemma3_spec
    assert isinstance(gemma3_spec.hf_adapter(gemma3_flavors["27B"]), Gemma3HFAdapter)


def test_readme_flavor_table_lists_every_flavor_with_its_exact_size():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Gemma 3") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for name, args in gemma3_flavors.items():
        row = next(r for r in rows if r.startswith(f"| `{name}` |"))
        assert f"{gemma3_param_count(args):,}" in row, name


def test_the_embedding_scale_is_rounded_to_the_tables_dtype_as_transformers_rounds_it():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from titan_models.gemma3.model import ScaledEmbedding

    ours = ScaledEmbedding(50, 1152).to(torch.bfloat16)
    theirs = Gemma3TextScaledWordEmbedding(50, 1152, padding_idx=0, embed_scale=1152**0.5)
    theirs = theirs.to(torch.bfloat16)
    theirs.embed_scale.fill_(1152**0.5)  # a buffer: float32, made in __init__ only
    theirs.weight.data.copy_(ours.weight.data)
    tokens = torch.arange(50)[None]
    assert ours.scales[torch.bfloat16] == 34.0  # sqrt(1152) = 33.94 in bf16
    assert torch.equal(ours(tokens), theirs(tokens))
