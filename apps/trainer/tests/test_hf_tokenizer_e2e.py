"""Each model family trains with a Hugging Face tokenizer.json (`--model.tokenizer_path
<folder>`), its vocabulary sizing the model; the Hugging Face export carries that vocabulary
and the tokenizer's BOS/EOS ids, an import keeps the vocabulary of the weights; a missing or
garbled tokenizer is a config error. Runs in this process (`titan-train`'s main), a few tiny
steps each: importing torch again per run would cost more than the runs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TRAINER, parse_losses

from titan_ckpt import export_hf
from titan_core.plugins import MODELS, resolve
from titan_data import load_tokenizer
from titan_trainer.cli import main as titan_train

# config: the tokenizer folder it trains with (Qwen's has no BOS: documents are text + EOS).
# Llama 3 trains with one in the import test below.
FAMILIES = {"qwen3_moe_debug": "qwen", "deepseek_v3_debug": "llama", "llama4_debug": "llama"}
EXPORT = [
    *("--checkpoint.enable", "--checkpoint.interval", "100"),
    *("--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf"),
]


def _args(config: str, dump, tokenizer: str, *extra: str) -> list[str]:
    return [
        *("--job.config_file", str(TRAINER / "configs" / f"{config}.toml")),
        *("--job.dump_folder", str(dump), "--model.tokenizer_path", tokenizer),
        *("--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2"),
        *("--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "1"),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"),
        *("--metrics.save_plots_folder", "", "--metrics.peak_tflops", "1"),
        *extra,
    ]


def _train(args: list[str], capsys) -> str:
    code = titan_train(args)
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    return out.out + out.err


def test_each_family_trains_with_a_tokenizer_json_that_sizes_its_vocabulary(
    hf_tokenizer_folders, tmp_path, capsys
):
    logs = {}
    for config, kind in FAMILIES.items():
        # One export is enough to see the ids reach config.json (the import test has another).
        # A centered router (the MoE debug flavors') has no Hugging Face counterpart.
        extra = [*EXPORT, "--model.moe_router_centering", "false"] if kind == "qwen" else []
        if config == "deepseek_v3_debug":
            # Its logged loss adds the MTP layer's weighted loss (1.3 x ln 1024 at the start);
            # the vocabulary shows in the next-token loss alone.
            extra = [*extra, "--model.n_mtp_layers", "0"]
        log = _train(_args(config, tmp_path / config, hf_tokenizer_folders[kind], *extra), capsys)
        losses = parse_losses(log)
        assert sorted(losses) == [1, 2], (config, log[-2000:])
        # The model's vocabulary is the tokenizer's (1,003 ids, padded to 1,024): a fresh model
        # predicts near-uniformly over it (the byte tokenizer's would give ln 320 = 5.8).
        assert abs(losses[1] - math.log(1024)) < 1.0, (config, losses)
        logs[config] = log
    # The first load of a tokenizer.json in a process says what it chose.
    assert (
        f"tokenizer: {hf_tokenizer_folders['qwen']}/tokenizer.json: 1,003 ids; no BOS (it has"
        " none): documents are text + EOS; EOS <|endoftext|>" in logs["qwen3_moe_debug"]
    ), logs["qwen3_moe_debug"][-3000:]
    # Qwen's folder names no BOS: its EOS starts documents, and is config.json's BOS too.
    tokenizer = load_tokenizer(hf_tokenizer_folders["qwen"])
    exported = tmp_path / "qwen3_moe_debug" / "checkpoint" / "step-2" / "hf" / "config.json"
    hf = json.loads(exported.read_text())
    assert hf["vocab_size"] == 1024
    assert hf["bos_token_id"] == hf["eos_token_id"] == tokenizer.eos_id == tokenizer.bos_id


def test_hf_weights_with_a_larger_vocabulary_import_with_it(hf_tokenizer_folders, tmp_path, capsys):
    """Hugging Face checkpoints pad their vocabulary beyond the tokenizer's (Qwen3: 151,936
    rows for 151,669 ids): the model takes the weights' size, the export keeps it."""
    spec = resolve(MODELS, "llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=1024 + 64, max_seq_len=32)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights()
    folder = tmp_path / "hf_in"
    export_hf(model.state_dict(), spec.hf_adapter(args), folder, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a download holds both
        shutil.copyfile(Path(hf_tokenizer_folders["llama"]) / name, folder / name)
    load = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf"]
    load += ["--checkpoint.initial_load_model_only", *EXPORT]
    log = _train(_args("debug_model", tmp_path / "run", str(folder), *load), capsys)
    assert "model: vocabulary 1,088 from the Hugging Face weights" in log, log[-2000:]
    assert "initialised the model from Hugging Face weights" in log
    exported = json.loads((tmp_path / "run/checkpoint/step-2/hf/config.json").read_text())
    assert exported["vocab_size"] == 1088
    tokenizer = load_tokenizer(str(folder))
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (
        tokenizer.bos_id,
        tokenizer.eos_id,
    )
    assert tokenizer.bos_id != tokenizer.eos_id

    # Weights with fewer rows than the tokenizer has ids: refused before start, naming both.
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    code = titan_train(_args("debug_model", tmp_path / "small", str(folder), *load))
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        f"titan: config error: [checkpoint] initial_load_path = '{folder}' holds weights for 512"
        " token ids (its config.json), fewer than the 1,003 of the tokenizer" in err
    ), err
    assert "Traceback" not in err


@pytest.mark.parametrize("what", ["missing", "garbled"])
def test_a_missing_or_garbled_tokenizer_json_is_a_config_error(what, tmp_path, capsys):
    path = tmp_path / "tok" / "tokenizer.json"
    if what == "garbled":
        path.parent.mkdir()
        path.write_text('{"version": "1.0", "added_tokens": [')
    code = titan_train(_args("debug_model", tmp_path / "run", str(path), *EXPORT))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    head = f"titan: config error: [model] tokenizer_path = '{path}' cannot be loaded: "
    expected = {
        "missing": f"tokenizer path {path} does not exist; fix the path",
        "garbled": f"{path} is not a tokenizer.json the tokenizers library can read (",
    }[what]
    assert head + expected in err, err
    assert "download it again" in err or what == "missing"


def test_the_readme_tokenizer_and_import_config_loads(tmp_path):
    from titan_core import load_config
    from titan_trainer.config import JobConfig

    readme = (TRAINER / "README.md").read_text()
    blocks = [b.split("```")[0] for b in readme.split("```toml\n")[1:]]
    (tmp_path / "job.toml").write_text(next(b for b in blocks if "tokenizer_path" in b))
    config = load_config(JobConfig, [], toml_path=tmp_path / "job.toml")
    assert config.model.tokenizer_path == config.checkpoint.initial_load_path
    assert config.checkpoint.initial_load_in_hf and config.checkpoint.initial_load_model_only
