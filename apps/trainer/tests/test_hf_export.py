"""Llama 3 exported by titan-ckpt loads in transformers' LlamaForCausalLM with the same logits,
and imports back to identical weights. Goes through the real path: a DCP checkpoint written by
the checkpoint manager, converted by the `titan-ckpt convert dcp-to-hf` command."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_ckpt import Checkpoint, CheckpointManager, import_hf
from titan_ckpt.cli import main as titan_ckpt
from titan_core.plugins import MODELS, resolve

transformers = pytest.importorskip(
    "transformers", reason="the logits comparison needs transformers (test extra)"
)

VOCAB, SEQ = 512, 64


def test_llama3_debugmodel_exported_to_hf_matches_transformers_logits(tmp_path):
    spec = resolve(MODELS, "llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=VOCAB, max_seq_len=SEQ)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights()
    model.eval()

    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1), {"model": model}, tmp_path / "ckpt"
    )
    manager.save(1)
    manager.close()
    overrides = ["--set", f"vocab_size={VOCAB}", "--set", f"max_seq_len={SEQ}"]
    code = titan_ckpt(
        [
            "convert",
            "dcp-to-hf",
            str(tmp_path / "ckpt" / "step-1"),
            str(tmp_path / "hf"),
            "--model",
            "llama3",
            "--flavor",
            "debugmodel",
            "--dtype",
            "float32",
            *overrides,
        ]
    )
    assert code == 0

    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    # fp32 on both sides; only the order of floating-point operations differs (attention kernel,
    # rotary formulation), which moves logits by ~1e-6 at this size.
    assert (ours - theirs).abs().max().item() <= 1e-4

    back = import_hf(tmp_path / "hf", spec.hf_adapter(args), progress=False)
    expected = model.state_dict()
    assert back.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(back[key], value), key
