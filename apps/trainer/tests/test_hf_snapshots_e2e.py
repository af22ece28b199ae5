"""Hugging Face snapshots on a schedule (`[checkpoint] hf_interval`) through the trainer: a
debug run writes `<checkpoint folder>/hf/step-<N>` at the right steps and keeps the newest
`hf_keep_latest_k`; each snapshot loads in transformers (model and tokenizer) with the Titan
model's logits; a run started from a snapshot saved with `hf_save_optimizer` repeats the
uninterrupted run's next losses; two FSDP processes write the snapshot one process writes;
bad settings are refused before training.

Every document of the data is the same window (conftest's `same_doc_dataset`), so that one
process and two data-parallel ones train on the same batches."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import DEBUG_TOML, parse_losses, run_cli
from safetensors.torch import load_file

from titan_ckpt import load_consolidated
from titan_core import ConfigError, load_config
from titan_core.plugins import MODELS, resolve
from titan_trainer.checks import check_config
from titan_trainer.config import JobConfig

transformers = pytest.importorskip(
    "transformers", reason="loading the snapshots needs transformers (test extra)"
)

STEPS = 6


def _args(dump, data, *extra: str) -> list[str]:
    return [
        "--job.config_file",
        str(DEBUG_TOML),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        "--metrics.save_plots_folder",
        "",
        "--training.dataset",
        data,
        "--training.steps",
        str(STEPS),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",  # DCP only at the last step: the snapshots are what is tested
        "--checkpoint.hf_interval",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def one(tmp_path_factory, same_doc_dataset):
    """A one-process run: snapshots every 2 steps, the newest 2 kept, with the training state;
    async checkpoints, so the snapshots' weights are written in the background."""
    tmp = tmp_path_factory.mktemp("one")
    result = run_cli(
        _args(
            tmp,
            same_doc_dataset,
            "--checkpoint.hf_keep_latest_k",
            "2",
            "--checkpoint.hf_save_optimizer",
            "--checkpoint.async_mode",
            "async",
        )
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp, result


def test_snapshots_at_the_interval_load_in_transformers_with_titans_logits(one):
    tmp, run = one
    folder = tmp / "checkpoint"
    hf = folder / "hf"
    # Steps 2, 4, 6 written; hf_keep_latest_k = 2 removed step 2; nothing unfinished is left.
    assert sorted(p.name for p in hf.iterdir()) == ["step-4", "step-6"]
    assert "removed old Hugging Face snapshot" in run.stdout + run.stderr
    assert "Hugging Face snapshot step 2: staged in" in run.stdout + run.stderr
    for step in (4, 6):
        marker = json.loads((hf / f"step-{step}" / "titan_snapshot.json").read_text())
        assert marker["step"] == step and marker["titan_state"] is True

    snapshot = hf / "step-6"
    model = transformers.AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(snapshot)
    text = "def add(a, b):\n    return a + b\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    # The Titan model of the same step, from the run's last DCP checkpoint.
    weights = load_consolidated(folder / "step-6", prefix="model.", progress=False)
    spec = resolve(MODELS, "llama3")
    args = dataclasses.replace(
        spec.flavors["debugmodel"],
        vocab_size=weights["tok_embeddings.weight"].shape[0],
        max_seq_len=128,
    )
    with torch.device("meta"):
        ours = spec.build(args)
    ours.to_empty(device="cpu")
    ours.init_weights()  # the buffers (rotary tables); the weights come next
    ours.load_state_dict(weights, strict=False)
    ours.eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():
        diff = (ours(tokens) - model(tokens).logits).abs().max().item()
    # fp32 on both sides; only the order of floating-point operations differs.
    assert diff <= 1e-4, diff


def test_a_run_started_from_a_snapshot_with_its_state_repeats_the_next_losses(
    one, same_doc_dataset, tmp_path
):
    tmp, run = one
    whole = parse_losses(run.stdout)
    again = run_cli(
        _args(
            tmp_path / "resumed",
            same_doc_dataset,
            "--checkpoint.hf_interval",
            "0",
            "--checkpoint.initial_load_path",
            str(tmp / "checkpoint" / "hf" / "step-4"),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "false",
        )
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resumed from the Hugging Face snapshot" in again.stdout + again.stderr
    resumed = parse_losses(again.stdout)
    assert sorted(resumed) == [5, 6]  # the step came back with the state
    # The float32 weights are those of the run, the optimizer, schedule and data position
    # its own: the same losses up to the printed precision.
    for step in (5, 6):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_two_fsdp_processes_write_the_snapshots_one_process_writes(one, same_doc_dataset, tmp_path):
    """2 data-parallel ranks (FSDP over gloo) x local batch 2 = the one-process run's batch of
    4, the same samples; each rank writes its own shards of the snapshot, in the background
    over the snapshots' own gloo group."""
    tmp, _ = one
    result = run_cli(
        _args(
            tmp_path,
            same_doc_dataset,
            "--training.local_batch_size",
            "2",
            "--checkpoint.hf_interval",
            "4",
            "--checkpoint.async_mode",
            "async",
        ),
        nproc=2,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Hugging Face snapshot step 4: staged in" in result.stdout + result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoint" / "hf").iterdir()) == [
        "step-4",
        "step-6",
    ]
    for step in (4, 6):
        _same_snapshot(
            tmp / "checkpoint" / "hf" / f"step-{step}",
            tmp_path / "checkpoint" / "hf" / f"step-{step}",
        )


def _same_snapshot(one, two) -> None:
    names = sorted(p.name for p in two.iterdir())
    assert names == sorted(p.name for p in one.iterdir() if p.name != "titan_state")
    for name in names:
        if name.endswith((".json", ".model", ".txt")) and name != "titan_snapshot.json":
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        # The same batches; only the order of the gradients' sums differs (FSDP's reduce).
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def _problems(args: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(JobConfig, args), 1)
    return str(info.value)


def test_bad_snapshot_settings_are_refused_before_training():
    assert "[checkpoint] hf_interval = -1 is not valid" in _problems(
        ["--checkpoint.enable", "--checkpoint.hf_interval", "-1"]
    )
    assert "[checkpoint] hf_keep_latest_k = -2 is not valid" in _problems(
        ["--checkpoint.enable", "--checkpoint.hf_keep_latest_k", "-2"]
    )
    assert "hf_save_optimizer = true saves beside Hugging Face snapshots" in _problems(
        ["--checkpoint.enable", "--checkpoint.hf_save_optimizer"]
    )
    assert "enable = false saves nothing" in _problems(["--checkpoint.hf_interval", "5"])
    assert "[checkpoint] hf_interval with qwen3 debugmodel_moe's router centering" in _problems(
        [
            *("--model.name", "qwen3", "--model.flavor", "debugmodel_moe"),
            *("--checkpoint.enable", "--checkpoint.hf_interval", "5"),
        ]
    )


def test_a_model_without_a_hugging_face_adapter_is_refused(tmp_path):
    from titan_ckpt import Checkpoint, CheckpointManager

    with pytest.raises(ValueError, match="hf_interval needs the model's HF adapter"):
        CheckpointManager(
            Checkpoint(enable=True, hf_interval=2), {"model": torch.nn.Linear(2, 2)}, tmp_path
        )
