import dataclasses

import pytest
import torch
from conftest import build_model

from titan_models import LlamaHFAdapter, llama3_flavors, llama3_spec

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")


def test_round_trip_is_exact_both_ways(tiny_args):
    for tied in (False, True):
        args = dataclasses.replace(tiny_args, tie_word_embeddings=tied)
        adapter = LlamaHFAdapter(args)
        ours = build_model(args).state_dict()
        hf = adapter.to_hf(ours)
        assert ("lm_head.weight" in hf) == (not tied)
        assert "model.layers.1.self_attn.q_proj.weight" in hf
        back = adapter.from_hf(hf)
        assert back.keys() == ours.keys()
        for name, tensor in ours.items():
            assert torch.equal(back[name], tensor), name
        again = adapter.to_hf(back)
        assert again.keys() == hf.keys()
        assert all(torch.equal(again[k], hf[k]) for k in hf)


def test_qk_permutation_changes_q_and_k_only(tiny_args):
    ours = build_model(tiny_args).state_dict()
    hf = LlamaHFAdapter(tiny_args).to_hf(ours)
    assert not torch.equal(
        hf["model.layers.0.self_attn.q_proj.weight"], ours["layers.0.attention.wq.weight"]
    )
    assert not torch.equal(
        hf["model.layers.0.self_attn.k_proj.weight"], ours["layers.0.attention.wk.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.self_attn.v_proj.weight"], ours["layers.0.attention.wv.weight"]
    )
    assert torch.equal(
        hf["model.layers.0.mlp.gate_proj.weight"], ours["layers.0.feed_forward.w1.weight"]
    )


def test_unknown_keys_are_named_in_the_error(tiny_args):
    adapter = LlamaHFAdapter(tiny_args)
    with pytest.raises(KeyError, match="layers.0.attention.bias"):
        adapter.to_hf({"layers.0.attention.bias": torch.zeros(1)})
    with pytest.raises(KeyError, match="model.rotary_emb.inv_freq"):
        adapter.from_hf({"model.rotary_emb.inv_freq": torch.zeros(1)})


@pytest.mark.parametrize("variant", ["rope_scaling", "no_rope_scaling", "tied"])
def test_logits_match_transformers_llama(tiny_args, variant):
    args = dataclasses.replace(
        tiny_args,
        use_rope_scaling=variant != "no_rope_scaling",
        tie_word_embeddings=variant == "tied",
    )
    model = build_model(args)
    with torch.no_grad():  # make the norm scales non-trivial so a misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    adapter = LlamaHFAdapter(args, torch_dtype="float32")
    config = transformers.LlamaConfig(**adapter.hf_config())
    hf_model = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf_model.load_state_dict(adapter.to_hf(model.state_dict()), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if args.tie_word_embeddings else set())
    if args.tie_word_embeddings:
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    # fp32, same math in a different order (half-split vs interleaved rotation): 1e-4 absolute.
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert theirs.abs().max() > 0.1  # the comparison is not between near-zero logits

    # Loading Hugging Face weights back gives our model the same function.
    reloaded = build_model(args, seed=123)
    reloaded.load_state_dict(adapter.from_hf(hf_model.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens), ours, rtol=0, atol=0)


def test_hf_config_describes_the_official_8b_checkpoint():
    config = LlamaHFAdapter(llama3_flavors["8B"]).hf_config()
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"]) == (4096, 14336)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (32, 8)
    assert config["num_hidden_layers"] == 32 and config["vocab_size"] == 128256
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert transformers.LlamaConfig(**config).intermediate_size == 14336


def test_spec_builds_the_hf_adapter():
    assert isinstance(llama3_spec.hf_adapter(llama3_flavors["1B"]), LlamaHFAdapter)
