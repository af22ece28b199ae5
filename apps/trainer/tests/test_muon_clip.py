"""MuonClip: titan-models' attention layers (Llama's grouped-query, DeepSeek-V3/Kimi K2's latent)
declare their query and key rows to titan-parallel's QK-Clip correctly (each head over tau
lands on tau, the others keep their logits), the trainer's checks, and a short Kimi K2 debug
run through the command a user types: `maxlogit` on the metric line, held near tau, loss falls."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import run_cli

from titan_core import ConfigError, load_config
from titan_models import llama3_flavors, llama3_spec
from titan_models.deepseek_v3 import deepseek_v3_flavors, deepseek_v3_spec
from titan_models.gpt_oss import gpt_oss_flavors, gpt_oss_spec
from titan_parallel import QKClip
from titan_trainer.checks import check_config
from titan_trainer.config import JobConfig
from titan_trainer.shipped import find_config_file

ONE_BLOCK = {
    # Grouped-query attention: 16 query heads over 8 key/value heads.
    "llama3": (llama3_spec, dataclasses.replace(llama3_flavors["debugmodel"], n_layers=1)),
    # Latent attention (compressed queries, a shared rotary key), no experts in one block.
    "kimi_k2": (
        deepseek_v3_spec,
        dataclasses.replace(deepseek_v3_flavors["kimi_k2_debug"], n_layers=1, moe=None),
    ),
    # Grouped-query attention with biases on q and k (scaled with their rows) and a window of
    # 16 (only the pairs within it count), the sinks left out of the logits.
    "gpt_oss": (
        gpt_oss_spec,
        dataclasses.replace(gpt_oss_flavors["debugmodel"], n_layers=1, sliding_window=16),
    ),
}


@pytest.mark.parametrize("family", list(ONE_BLOCK))
def test_model_attention_heads_over_tau_land_on_tau_and_the_others_keep_theirs(family):
    spec, args = ONE_BLOCK[family]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights()
    (layer,) = [m for m in model.modules() if hasattr(m, "qk_clip_layout")]
    with torch.no_grad():  # sharp attention: logits far from the init's
        for rows in layer.qk_clip_layout().rows:
            if rows.weight.ndim == 1:  # a bias: zero at init
                rows.weight.normal_(0, 0.5)
            rows.weight.mul_(8.0)
    # One block: the attention's input does not depend on the weights the clip changes.
    clip = QKClip([model], tau=1.0)
    probe = QKClip([model], tau=None)  # records only
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    model(tokens)
    before = probe._records[0].clone()
    tau = before.median().item()  # about half the heads over it
    clip.tau = tau
    probe.clip_()
    clip.clip_()
    model(tokens)
    after = probe._records[0]
    over = before > tau
    assert 0 < over.sum() < before.numel(), before
    expected = torch.where(over, torch.full_like(before, tau), before)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=0)  # float32 recomputation


def _check(*args: str):
    config = load_config(
        JobConfig,
        ["--job.config_file", "kimi_k2_debug", *args],
        find_config_file=find_config_file,
    )
    return check_config(config, 2)


def test_qk_clip_needs_muon_and_no_context_parallel():
    with pytest.raises(ConfigError, match="qk_clip_tau = 100.0 does nothing with"):
        _check("--optimizer.name", "AdamW")
    with pytest.raises(ConfigError, match="context_parallel_degree 2 splits"):
        _check("--parallelism.context_parallel_degree", "2")
    _check("--optimizer.muon.qk_clip_tau", "0")  # off: any layout
    # QK-norm after the projections would undo their scaling: refused, with the reason.
    with pytest.raises(ConfigError, match=r"normalises each query and key head .* \(QK-norm\)"):
        _check("--model.name", "qwen3", "--model.flavor", "debugmodel")


def test_max_attention_logit_monitor_works_with_any_optimizer_and_shares_the_clips_limits():
    _check("--optimizer.name", "AdamW", "--optimizer.muon.qk_clip_tau", "0",
           "--metrics.max_attention_logit", "true")  # fmt: skip
    with pytest.raises(ConfigError, match=r"max_attention_logit needs each head's logits"):
        _check("--optimizer.muon.qk_clip_tau", "0", "--metrics.max_attention_logit", "true",
               "--parallelism.context_parallel_degree", "2")  # fmt: skip


def test_adamw_run_with_the_logit_monitor_logs_it_and_steps_as_without(tmp_path):
    runs = {}
    for monitor in ("false", "true"):
        result = run_cli(
            [
                *("--job.config_file", "debug_model", "--job.dump_folder", str(tmp_path / monitor)),
                *("--training.steps", "3", "--training.local_batch_size", "2"),
                *("--training.seq_len", "64", "--metrics.log_freq", "1"),
                *("--metrics.max_attention_logit", monitor, "--metrics.save_plots_folder", ""),
                *("--training.mixed_precision_param", "float32"),
            ],
            timeout=600,
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-4000:]
        runs[monitor] = out
    losses = {k: re.findall(r"step +\d+ \| loss ([\d.]+)", out) for k, out in runs.items()}
    assert len(losses["true"]) == 3 and losses["true"] == losses["false"], losses  # record only
    logits = re.findall(r"\| maxlogit ([-\d.]+)", runs["true"])
    assert len(logits) == 3 and all(float(x) > 0 for x in logits), runs["true"][-3000:]
    assert "maxlogit" not in runs["false"]


def test_kimi_k2_debug_run_with_muon_clip_logs_the_max_logit_and_trains(tmp_path):
    tau = 0.3  # under the debug model's largest logits from the start (about 0.4)
    result = run_cli(
        [
            *("--job.config_file", "kimi_k2_debug", "--job.dump_folder", str(tmp_path)),
            *("--training.steps", "6", "--training.local_batch_size", "4"),
            *("--training.seq_len", "64", "--metrics.log_freq", "1"),
            *("--optimizer.muon.qk_clip_tau", str(tau), "--metrics.save_plots_folder", ""),
            *("--optimizer.muon.ns_dtype", "float32"),  # bfloat16 matmuls are slow on CPUs
        ],
        timeout=900,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    rows = re.findall(r"step +(\d+) \| loss ([\d.]+) .*\| maxlogit ([-\d.]+)", out)
    assert len(rows) == 6, out[-4000:]
    losses = [float(r[1]) for r in rows]
    logits = [float(r[2]) for r in rows]
    print("losses", losses, "max logits", logits)
    assert losses[-1] < losses[0] - 0.5, losses
    assert max(logits) > tau  # the clip had work to do
    # After a clip the next step's logits start from tau: one optimizer step moves them a little.
    for previous, current in zip(logits, logits[1:]):
        assert current < max(previous, tau) * 1.5, logits
    assert list(tmp_path.rglob("events.out.tfevents*")), "TensorBoard got the metrics"
