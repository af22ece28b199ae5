"""Qwen3, dense and mixture-of-experts: flavors at their published sizes, FLOPs over active
parameters, the model against Hugging Face transformers' Qwen3ForCausalLM and
Qwen3MoeForCausalLM (logits within 1e-4 in float32, weights going both ways through the Hub's
file layout), and the pieces the trainer relies on (tied embeddings, init by name, meta build)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from titan_models.qwen3 import (
    Qwen3HFAdapter,
    Qwen3Transformer,
    qwen3_flavors,
    qwen3_flops_per_token,
    qwen3_param_count,
    qwen3_spec,
)

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def build(args, seed: int = 0) -> Qwen3Transformer:
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


# Published totals (and active parameters for the MoE models), in billions.
PUBLISHED = {"0.6B": 0.6, "1.7B": 1.7, "4B": 4.0, "8B": 8.2, "14B": 14.8, "32B": 32.8,
             "30B-A3B": 30.5, "235B-A22B": 235.1}  # fmt: skip
ACTIVE = {"30B-A3B": 3.3, "235B-A22B": 22.0}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavors_have_their_published_sizes(flavor):
    args = qwen3_flavors[flavor]
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    counted = sum(p.numel() for p in model.parameters())  # a tied matrix once
    assert counted == qwen3_param_count(args)
    assert abs(counted / 1e9 - PUBLISHED[flavor]) / PUBLISHED[flavor] < 0.05, counted
    if flavor in ACTIVE:
        active = qwen3_param_count(args, active=True)
        assert abs(active / 1e9 - ACTIVE[flavor]) / ACTIVE[flavor] < 0.06, active
        # FLOPs count the experts a token goes through, not all of them.
        dense_equivalent = dataclasses.replace(
            args, moe=None, hidden_dim=args.moe.hidden_dim * args.moe.num_experts
        )
        assert qwen3_flops_per_token(args, 4096) < 0.3 * qwen3_flops_per_token(
            dense_equivalent, 4096
        )


def test_small_flavors_tie_the_embedding_and_build_on_meta():
    for flavor in ("0.6B", "1.7B", "4B", "debugmodel"):
        assert qwen3_flavors[flavor].tie_word_embeddings
    model = build(qwen3_flavors["debugmodel"])
    assert model.output.weight is model.tok_embeddings.weight
    again = build(qwen3_flavors["debugmodel"])
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name  # init is a function of (seed, name)


def _small(moe: bool, tied: bool):
    args = qwen3_flavors["debugmodel_moe" if moe else "debugmodel"]
    return dataclasses.replace(args, n_layers=2, dim=64, head_dim=16, n_heads=4, n_kv_heads=2,
                               hidden_dim=96, vocab_size=300, max_seq_len=32,
                               tie_word_embeddings=tied)  # fmt: skip


def _randomise_norms(model):
    with torch.no_grad():  # non-trivial norm scales, so that a misplaced norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("moe,tied", [(False, True), (False, False), (True, False)])
def test_logits_match_transformers_both_ways(tmp_path, moe, tied):
    args = _small(moe, tied)
    model = build(args).eval()  # inference: the debug flavor limits expert load in training
    _randomise_norms(model)
    adapter = Qwen3HFAdapter(args, torch_dtype="float32")
    # Export: our weights in the Hub's layout, loaded by transformers.
    out = tmp_path / "export"
    out.mkdir()
    hf = adapter.to_hf(model.state_dict())
    if moe:
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors"
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected_class = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    assert type(hf_model).__name__ == expected_class
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    print(f"max |logit difference| {'MoE' if moe else 'dense'}: {(ours - theirs).abs().max():.2e}")
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


def test_export_refuses_a_trained_expert_bias():
    args = _small(moe=True, tied=False)
    state = build(args).state_dict()
    state["layers.1.feed_forward.expert_bias"][3] = 0.01
    with pytest.raises(ValueError, match="layer 1 has a non-zero expert bias"):
        Qwen3HFAdapter(args).to_hf(state)


def test_export_refuses_a_moved_router_center_and_import_zeroes_it():
    args = _small(moe=True, tied=False)  # the debug flavor's router centering
    state = build(args).state_dict()
    assert torch.equal(state["layers.0.feed_forward.router_center"], torch.zeros(args.dim))
    hf = Qwen3HFAdapter(args).to_hf(state)  # zero: nothing of it in their format
    assert not [k for k in hf if "center" in k]
    assert torch.equal(
        Qwen3HFAdapter(args).from_hf(hf)["layers.1.feed_forward.router_center"],
        torch.zeros(args.dim),
    )
    state["layers.1.feed_forward.router_center"][3] = 0.01
    with pytest.raises(ValueError, match="layer 1 has a non-zero router center"):
        Qwen3HFAdapter(args).to_hf(state)


def test_a_centered_router_decodes_with_a_cache_as_a_full_forward():
    """Generation routes as validation and training: each MoE layer subtracts its router
    center from every token, the cached one-token steps included."""
    from conftest import decode_in_pieces

    args = _small(moe=True, tied=False)
    model = build(args).eval()
    with torch.no_grad():
        for block in model.layers.values():  # a center that moves the routing
            block.feed_forward.router_center.normal_(std=1.0)
    full, cached, _ = decode_in_pieces(model, args.vocab_size)
    assert (cached - full).abs().max().item() <= 1e-5  # fp32, as the dense model's test
    with torch.no_grad():
        for block in model.layers.values():
            block.feed_forward.router_center.zero_()
        uncentered = model(
            torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        )
    assert (uncentered - full).abs().max().item() > 1e-3  # the center did change the routing


def test_expert_bias_starts_at_zero_from_the_plan_whatever_memory_held():
    # A saved buffer that the routing reads: sharded runs initialise from the plan alone
    # (titan-parallel's init_weights_exact), so the plan must name it.
    from titan_core.init import init_from_plan_

    args = dataclasses.replace(qwen3_flavors["debugmodel_moe"], n_layers=2)
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    model.to_empty(device="cpu")
    for block in model.layers.values():
        block.feed_forward.expert_bias.fill_(float("nan"))
        block.feed_forward.router_center.fill_(float("nan"))  # the same for router centering
    assert init_from_plan_(model, model.init_plan(), seed=0) == []
    for block in model.layers.values():
        assert torch.equal(block.feed_forward.expert_bias, torch.zeros(8))
        assert torch.equal(block.feed_forward.router_center, torch.zeros(args.dim))


def test_the_family_is_registered_as_qwen3():
    from titan_core import plugins, resolve

    assert resolve(plugins.MODELS, "qwen3") is qwen3_spec
    assert isinstance(qwen3_spec.hf_adapter(qwen3_flavors["8B"]), Qwen3HFAdapter)


def test_readme_flavor_table_lists_every_flavor_with_its_exact_sizes():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## Qwen3") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for name, args in qwen3_flavors.items():
        row = next(r for r in rows if r.startswith(f"| `{name}` |"))
        assert f"{qwen3_param_count(args):,}" in row, name
        if args.moe is not None:
            assert f"{qwen3_param_count(args, active=True):,}" in row, name
