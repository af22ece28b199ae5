"""Hugging Face safetensors export/import through an HFAdapter, and the titan-ckpt CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_toy import ToyModel, assert_same, build_run, full_model, train
from ckpt_toy_hf import SlicedToyAdapter, ToyAdapter, ToyArgs
from safetensors import safe_open

from titan_ckpt import (
    Checkpoint,
    CheckpointLoadError,
    CheckpointManager,
    export_hf,
    import_hf,
    load_hf_weights,
    read_safetensors,
    save_hf_weights,
)
from titan_ckpt.cli import main

SPEC = "ckpt_toy_hf:TOY_SPEC"
SLICED_SPEC = "ckpt_toy_hf:SLICED_TOY_SPEC"


def _weights(seed=0):
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in ToyModel().state_dict().items()}


def test_export_then_import_gives_the_exact_tensors_back_across_shards(tmp_path):
    weights = _weights()
    files = export_hf(
        weights, ToyAdapter(ToyArgs()), tmp_path, max_shard_bytes=20_000, progress=False
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    assert "lm_head.weight" in index["weight_map"] and len(files) == len(shards) + 2
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"
    assert read_safetensors(tmp_path, progress=False)["lm_head.weight"].shape == (
        32,
        64,
    )  # stored transposed
    assert_same(
        weights, import_hf(tmp_path, ToyAdapter(ToyArgs()), progress=False), "HF round trip"
    )


def test_export_dtype_casts_floating_weights(tmp_path):
    weights = _weights()
    export_hf(weights, ToyAdapter(ToyArgs()), tmp_path, dtype="bfloat16", progress=False)
    assert (tmp_path / "model.safetensors").is_file()
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = import_hf(tmp_path, ToyAdapter(ToyArgs()), progress=False)
    assert_same({k: v.to(torch.bfloat16) for k, v in weights.items()}, back, "bf16 export")


def test_cli_converts_dcp_to_hf_to_dcp_and_to_a_torch_file(tmp_path, capsys):
    run = build_run(dropout=0.0)
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1),
        run.states(),
        tmp_path / "ckpt",
        config_toml='[model]\nname = "ckpt_toy_hf:TOY_SPEC"\nflavor = "tiny"\n',
    )
    train(run, 1, manager)
    manager.close()
    step = tmp_path / "ckpt" / "step-1"
    expected = full_model(run.model)

    assert (
        main(["convert", "dcp-to-hf", str(step), str(tmp_path / "hf")]) == 0
    )  # model named by config.toml
    assert_same(
        expected, import_hf(tmp_path / "hf", ToyAdapter(ToyArgs()), progress=False), "dcp -> hf"
    )

    assert (
        main(
            [
                "convert",
                "hf-to-dcp",
                str(tmp_path / "hf"),
                str(tmp_path / "from_hf"),
                "--model",
                SPEC,
                "--flavor",
                "tiny",
            ]
        )
        == 0
    )
    fresh = build_run(seed=4, dropout=0.0)
    cfg = Checkpoint(enable=True, initial_load_path=str(tmp_path / "from_hf"))
    assert CheckpointManager(cfg, fresh.states(), tmp_path / "new_run").load() == 0
    assert_same(expected, full_model(fresh.model), "hf -> dcp -> model")

    assert main(["convert", "dcp-to-torch", str(step), str(tmp_path / "all.pt")]) == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert_same(expected, everything["model"], "dcp -> torch file")
    assert everything["train_state"] == {"step": 1, "tokens_seen": 32}
    assert everything["dataloader"]["dp0"] == {"position": 1, "seed": 7}
    assert everything["config"] == {
        "toml": '[model]\nname = "ckpt_toy_hf:TOY_SPEC"\nflavor = "tiny"\n'
    }
    assert any(k.startswith("state.layers.0.w1.weight.exp_avg") for k in everything["optimizer"])

    assert main(["list", str(tmp_path / "ckpt")]) == 0
    assert "step        1  full" in capsys.readouterr().out
    assert (
        main(
            [
                "convert",
                "dcp-to-hf",
                str(step),
                str(tmp_path / "x"),
                "--model",
                SPEC,
                "--flavor",
                "huge",
            ]
        )
        == 2
    )
    assert "no flavor 'huge'" in capsys.readouterr().err


ADAPTERS = {"whole": ToyAdapter, "sliced": SlicedToyAdapter}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_initial_load_from_hugging_face_weights(tmp_path, adapter):
    weights = _weights(seed=8)
    export_hf(weights, ToyAdapter(ToyArgs()), tmp_path / "hf", progress=False)
    run = build_run(seed=1)
    cfg = Checkpoint(enable=True, initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True)
    manager = CheckpointManager(
        cfg, run.states(), tmp_path / "ckpt", hf_adapter=ADAPTERS[adapter](ToyArgs())
    )
    assert manager.load() == 0
    assert_same(weights, full_model(run.model), "initial load from HF")


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_last_save_in_hf_writes_safetensors_inside_the_final_checkpoint(tmp_path, adapter):
    run = build_run(dropout=0.0)
    cfg = Checkpoint(enable=True, interval=10, last_save_in_hf=True, export_dtype="float16")
    hf_adapter = ADAPTERS[adapter](ToyArgs())
    manager = CheckpointManager(cfg, run.states(), tmp_path, hf_adapter=hf_adapter)
    train(run, 2, manager, last_step=2)
    manager.close()
    back = import_hf(tmp_path / "step-2" / "hf", ToyAdapter(ToyArgs()), progress=False)
    assert_same({k: v.half() for k, v in full_model(run.model).items()}, back, "last save in HF")


def test_dcp_to_hf_writes_the_vocab_size_of_the_saved_tensors_not_the_flavors(tmp_path):
    # A trainer pads the tokenizer's vocabulary: the flavor says 64 rows, the tensors have 96.
    torch.manual_seed(0)
    model = ToyModel(vocab=96)
    manager = CheckpointManager(
        Checkpoint(enable=True, interval=1),
        {"model": model},
        tmp_path / "ckpt",
        config_toml='[model]\nname = "ckpt_toy_hf:TOY_SPEC"\nflavor = "tiny"\n',
    )
    manager.save(1)
    manager.close()
    assert (
        main(["convert", "dcp-to-hf", str(tmp_path / "ckpt" / "step-1"), str(tmp_path / "hf")]) == 0
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 96
    back = import_hf(tmp_path / "hf", ToyAdapter(ToyArgs(vocab_size=96)), progress=False)
    assert_same(full_model(model), back, "padded vocabulary round trip")


def test_sliced_export_writes_what_export_hf_writes_in_files_safetensors_reads(tmp_path):
    weights = _weights()
    model = ToyModel()
    model.load_state_dict(weights)
    files = save_hf_weights(
        model, SlicedToyAdapter(ToyArgs()), tmp_path / "sliced", max_shard_bytes=20_000
    )
    export_hf(weights, ToyAdapter(ToyArgs()), tmp_path / "whole", max_shard_bytes=20_000,
              progress=False)  # fmt: skip
    index = json.loads((tmp_path / "sliced" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and [f.name for f in files] == [
        *shards,
        "model.safetensors.index.json",
        "config.json",
    ]
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    assert_same(
        read_safetensors(tmp_path / "whole", progress=False),
        read_safetensors(tmp_path / "sliced", progress=False),
        "sliced export",
    )
    for shard in shards:  # each file's header lists what the index says it holds
        with safe_open(str(tmp_path / "sliced" / shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(
                k for k, v in index["weight_map"].items() if v == shard
            )
            assert f.metadata() == {"format": "pt"}
    config = json.loads((tmp_path / "sliced" / "config.json").read_text())
    assert config == {**ToyAdapter(ToyArgs()).hf_config(), "torch_dtype": "float32"}


def test_sliced_export_casts_and_fits_one_file(tmp_path):
    model = ToyModel()
    save_hf_weights(model, SlicedToyAdapter(ToyArgs()), tmp_path, dtype="bfloat16")
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    back = read_safetensors(tmp_path, progress=False)
    assert back["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(back["lm_head.weight"], model.out.weight.detach().t().bfloat16())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sliced_import_fills_the_model_in_place(tmp_path):
    weights = _weights(seed=3)
    export_hf(weights, ToyAdapter(ToyArgs()), tmp_path, max_shard_bytes=20_000, progress=False)
    model = ToyModel()
    before = model.out.weight
    load_hf_weights(model, SlicedToyAdapter(ToyArgs()), tmp_path)
    assert model.out.weight is before  # the same parameter, its values replaced
    assert_same(weights, full_model(model), "sliced import")


def test_sliced_import_refuses_a_checkpoint_of_another_shape_before_reading(tmp_path):
    weights = {k: v.clone() for k, v in ToyModel(vocab=96).state_dict().items()}
    export_hf(weights, ToyAdapter(ToyArgs(vocab_size=96)), tmp_path, progress=False)
    model = ToyModel()
    before = full_model(model)
    with pytest.raises(CheckpointLoadError) as error:
        load_hf_weights(model, SlicedToyAdapter(ToyArgs()), tmp_path)
    message = str(error.value)
    assert "embed.weight has shape [96, 32] there and [64, 32] in the model" in message
    assert "choose the model and flavor the checkpoint was saved from" in message
    assert_same(before, full_model(model), "untouched after a refusal")


@pytest.mark.slow  # a torchrun of 2 ranks; the conversions on 2 ranks: test_distributed.py
def test_cli_conversion_under_torchrun_starts_its_process_group(tmp_path):
    """`torchrun --nproc-per-node 2 --no-python titan-ckpt convert dcp-to-hf` (the README's
    form): both ranks convert; the files equal the one-process export."""
    run = build_run(dropout=0.0)
    manager = CheckpointManager(Checkpoint(enable=True, interval=1), run.states(), tmp_path / "c")
    train(run, 1, manager)
    manager.close()
    step, hf = str(tmp_path / "c" / "step-1"), ["--model", SLICED_SPEC, "--flavor", "tiny"]
    assert main(["convert", "dcp-to-hf", step, str(tmp_path / "one"), *hf]) == 0

    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    script = str(Path(sys.executable).with_name("titan-ckpt"))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--no-python", script, "convert", "dcp-to-hf", step, str(tmp_path / "two"), *hf,
         "--max-shard-gb", "1e-5"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("wrote ") == 1  # rank 0 speaks for both
    one = read_safetensors(tmp_path / "one", progress=False)
    two = read_safetensors(tmp_path / "two", progress=False)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert (tmp_path / "two" / "model.safetensors.index.json").is_file()


def test_cli_commands_other_than_the_hf_conversions_refuse_torchrun(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    assert main(["list", str(tmp_path)]) == 2
    assert "titan-ckpt list runs in one process; run it without torchrun" in capsys.readouterr().err
