"""GPT-OSS: flavors at their published sizes (parameter counts equal to transformers' model of
the same config, built on the meta device), the model against Hugging Face transformers'
GptOssForCausalLM (logits within 1e-4 in float32 over sequences longer than the sliding
window, weights going both ways through the Hub's layout, and the sharded converter's boxes),
generation with a KV cache equal to the full forward, and the pieces the trainer relies on."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from titan_models.gpt_oss import (
    GptOssHFAdapter,
    GptOssTransformer,
    gpt_oss_flavors,
    gpt_oss_flops_per_token,
    gpt_oss_param_count,
)
from titan_models.hf_adapter import box_shape

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# OpenAI's model card: total and active parameters, in billions.
PUBLISHED = {"20B": (20.91, 3.61), "120B": (116.83, 5.13)}


def build(args, seed: int = 0) -> GptOssTransformer:
    with torch.device("meta"):
        model = GptOssTransformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _hf_config(args):
    adapter = GptOssHFAdapter(args, torch_dtype="float32")
    config = adapter.hf_config()
    return transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "architectures"})


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavors_count_as_transformers_and_the_model_card(flavor):
    args = gpt_oss_flavors[flavor]
    with torch.device("meta"):
        ours = GptOssTransformer(args)
        theirs = transformers.GptOssForCausalLM(_hf_config(args))
    counted = sum(p.numel() for p in ours.parameters())
    assert counted == gpt_oss_param_count(args)
    assert counted == sum(p.numel() for p in theirs.parameters())
    total, active = PUBLISHED[flavor]
    print(
        f"{flavor}: {counted / 1e9:.3f}B, active {gpt_oss_param_count(args, active=True) / 1e9:.3f}B"
    )
    assert abs(counted / 1e9 - total) / total < 0.01
    # The card's active count leaves out the embedding table (a lookup, not a matmul).
    active_counted = gpt_oss_param_count(args, active=True) - args.vocab_size * args.dim
    assert abs(active_counted / 1e9 - active) / active < 0.01, active_counted


def test_flops_count_the_window_and_the_active_experts():
    args = gpt_oss_flavors["120B"]
    full = dataclasses.replace(args, sliding_window=1 << 30)
    # At 8192 positions half the blocks attend over 128 keys, not 8192.
    saved = gpt_oss_flops_per_token(full, 8192) - gpt_oss_flops_per_token(args, 8192)
    assert saved == 12 * args.n_heads * args.head_dim * (args.n_layers // 2) * (8192 - 128)
    matmul = 6 * (gpt_oss_param_count(args, active=True) - args.vocab_size * args.dim)
    assert 0.95 < (gpt_oss_flops_per_token(args, 1) / matmul) < 1.05


def _small(window: int = 8):
    args = gpt_oss_flavors["debugmodel"]
    moe = dataclasses.replace(args.moe, num_experts=4, top_k=2, hidden_dim=32,
                              capacity_factor=None, router_centering=False)  # fmt: skip
    return dataclasses.replace(args, n_layers=4, dim=64, head_dim=16, n_heads=4, n_kv_heads=2,
                               vocab_size=128, max_seq_len=48, sliding_window=window, moe=moe)  # fmt: skip


def _randomise(model):
    with torch.no_grad():  # non-zero biases and sinks, norm scales away from 1, large
        for name, p in model.named_parameters():  # enough activations to reach the clamp
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") or "sinks" in name:
                p.normal_(0, 0.5)
            elif "experts.w" in name:
                p.normal_(0, 0.3)


def _hf_weights(folder):
    weights = {}
    for f in folder.glob("*.safetensors"):
        weights |= safetensors_torch.load_file(f)
    return weights


def test_logits_match_transformers_both_ways(tmp_path):
    args = _small()
    model = build(args).eval()
    _randomise(model)
    adapter = GptOssHFAdapter(args, torch_dtype="float32")
    out = tmp_path / "export"
    out.mkdir()
    hf = adapter.to_hf(model.state_dict())
    assert hf["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf.items()}, out / "model.safetensors"
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(hf_model).__name__ == "GptOssForCausalLM"
    assert hf_model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))  # 48 > the window of 8
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(input_ids=tokens).logits
    error = (ours - theirs).abs().max().item()
    print(f"max |logit difference| GPT-OSS: {error:.2e} (logits up to {theirs.abs().max():.2f})")
    assert error <= 1e-4
    assert theirs.abs().max() > 0.1
    # The window, the sinks and the clamp each matter at this size: without them, far off.
    for change in ({"sliding_window": 1 << 20}, {"attention_sinks": False}):
        other = build(dataclasses.replace(args, **change)).eval()
        other.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            assert (other(tokens) - theirs).abs().max() > 1e-2, change

    # Import: what transformers writes, into a differently seeded model of ours.
    saved = tmp_path / "saved"
    hf_model.save_pretrained(saved)
    reloaded = build(args, seed=123).eval()
    reloaded.load_state_dict(adapter.from_hf(_hf_weights(saved)))
    with torch.no_grad():
        assert (reloaded(tokens) - theirs).abs().max().item() <= 1e-4


def test_sliced_conversion_equals_the_whole(tmp_path):
    """The boxes the sharded converter reads and writes (a rank's shards) give the same
    Hugging Face tensors as converting the whole state dict."""
    args = _small()
    model = build(args)
    _randomise(model)
    adapter = GptOssHFAdapter(args, torch_dtype="float32")
    state = model.state_dict()
    whole = adapter.to_hf(state)
    rebuilt = {k: torch.full_like(v, float("nan")) for k, v in whole.items()}
    for name, tensor in state.items():
        # Two boxes per tensor, split along the last dimension (as TP/FSDP shards can be).
        cut = tensor.shape[-1] // 2 if tensor.ndim else 0
        boxes = [(slice(0, cut),), (slice(cut, tensor.shape[-1]),)] if tensor.ndim else [()]
        for last in boxes:
            index = (*(slice(0, s) for s in tensor.shape[:-1]), *last)
            if any(s.stop == s.start for s in index):
                continue
            piece = tensor[index]
            for hf, values in adapter.to_hf_slices(name, tuple(tensor.shape), index, piece):
                assert tuple(values.shape) == box_shape(hf.index), hf
                rebuilt[hf.name][hf.index] = values

            def read(hf):
                return whole[hf.name][hf.index]

            back = adapter.from_hf_slice(name, tuple(tensor.shape), index, read)
            assert torch.equal(back, piece), name
    for name, tensor in whole.items():
        assert torch.equal(rebuilt[name], tensor), name


def test_generation_with_a_cache_equals_the_full_forward():
    """Decoding token by token through the KV cache (windowed layers see the last `window`
    positions, sinks in every softmax) gives the logits of one forward over the sequence."""
    from titan_models.generation import KVCache

    args = _small(window=5)
    model = build(args).eval()
    _randomise(model)
    tokens = torch.randint(0, args.vocab_size, (1, 20))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(args.max_seq_len)
        steps = [model(tokens[:, :7], kv_cache=cache)]
        steps += [model(tokens[:, i : i + 1], kv_cache=cache) for i in range(7, 20)]
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-5


def test_debug_flavor_builds_and_trains_a_step():
    args = gpt_oss_flavors["debugmodel"]
    assert [args.attention_window(i) for i in range(4)] == [128, None, 128, None]
    model = build(args)
    tokens = torch.randint(0, args.vocab_size, (2, 256))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    sinks = model.layers["0"].attention.sinks.weight
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    assert model.layers["0"].feed_forward.down_bias.grad.abs().sum() > 0
