"""The memory-saving modes through the trainer: `[training] dtype = "bfloat16"` (parameters,
gradients and optimizer state in bf16, saved and resumed as such), `[activation_checkpoint]
mode = "memory_budget"` and `cpu_offload`; each in the dry run's prediction. The loss gap of
bf16 against mixed precision is measured in bench/low_memory.py, not here."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import fp32_args

from titan_core import ConfigError, load_config, plugins, resolve
from titan_trainer.config import JobConfig
from titan_trainer.preflight import preflight_problems
from titan_trainer.shipped import find_config_file
from titan_trainer.train import train

BF16 = ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]


def _load(args: list[str]) -> JobConfig:
    return load_config(JobConfig, args, find_config_file=find_config_file)


def _saved_dtypes(folder) -> dict[str, torch.dtype]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    return {
        key: item.properties.dtype
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def test_bf16_training_saves_bf16_weights_and_moments_and_resumes_exactly(
    debug_args, same_doc_dataset, tmp_path
):
    args = [
        *fp32_args(debug_args, same_doc_dataset),
        *BF16,
        *("--checkpoint.enable", "--checkpoint.interval", "2"),
    ]
    whole = train(_load(args))
    assert len(whole.losses) == 4
    folder = tmp_path / "run" / "checkpoint"
    dtypes = _saved_dtypes(folder / "step-4")
    weights = {k: d for k, d in dtypes.items() if k.startswith("model.") and "freqs" not in k}
    moments = {k: d for k, d in dtypes.items() if "exp_avg" in k}
    assert weights and moments
    # No float32 master copy anywhere: the weights and AdamW's moments are bfloat16.
    assert set(weights.values()) == {torch.bfloat16}, weights
    assert set(moments.values()) == {torch.bfloat16}, moments

    shutil.rmtree(folder / "step-4")
    resumed = train(_load(args))
    # The same bf16 kernels on the same bf16 state and batches: equal to the last bit.
    assert resumed.losses == whole.losses[2:], (resumed.losses, whole.losses)


@pytest.mark.parametrize("name", ["Adam", "Ranger21", "Muon"])
def test_each_optimizer_steps_bf16_parameters_and_keeps_its_state_dtype(name):
    from titan_trainer.model import model_args_for
    from titan_trainer.optimizer import build_optimizer
    from titan_trainer.precision import cast_parameters_

    config = _load(["--job.config_file", "debug_model", "--optimizer.name", name])
    spec = resolve(plugins.MODELS, config.model.name)
    torch.manual_seed(0)
    model = spec.build(model_args_for(spec, config, 300))
    for key in list(model.layers)[1:]:  # one block says it all, and steps faster
        del model.layers[key]
    cast_parameters_(model, torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer([model], config.optimizer, total_steps=10)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, n
        assert not torch.equal(p, before[n]), f"{n} did not move"
    states = {
        k: v.dtype
        for s in optimizer.state.values()
        for k, v in s.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }
    # Ranger21 keeps its moments in [optimizer] state_dtype (float32 by default) and
    # Lookahead's slow weights in the parameters' dtype; the others follow the parameters.
    want = {torch.float32, torch.bfloat16} if name == "Ranger21" else {torch.bfloat16}
    assert set(states.values()) == want, states


def test_dry_run_counts_bf16_state_at_half_and_offload_off_the_device():
    from titan_parallel.memory_estimate import fake_process_group
    from titan_trainer.dry_run import measure_rank

    vocab = resolve(plugins.DATA, "titan").build_tokenizer("byte").vocab_size
    base = ["--job.config_file", "debug_model", "--training.seq_len", "64"]
    base += ["--training.local_batch_size", "2", "--training.mixed_precision_param", "bfloat16"]

    def predict(extra):
        with fake_process_group(1):
            return measure_rank(_load([*base, *extra]), 1, vocab, "r", fake=True, kernels="cuda")

    mixed, bf16 = predict([]), predict(BF16[:2])
    # Fake tensors cost nothing: a long sequence, so that activations make the peak. With
    # bf16 parameters there is no autocast, whose cache of bf16 weight copies would add to
    # them (and is offloaded for nothing: see the README).
    long = [*BF16[:2], "--training.seq_len", "2048", "--training.local_batch_size", "8"]
    kept = predict(long)
    offload = predict([*long, "--activation_checkpoint.cpu_offload", "true"])
    # The same parameters at 2 bytes instead of 4, gradients and AdamW's two moments alike.
    for kind in ("parameters", "gradients", "optimizer"):
        assert getattr(bf16.step, kind) * 2 == pytest.approx(getattr(mixed.step, kind), rel=0.02)
    assert kept.offloaded == 0 and offload.offloaded > 0
    # The blocks' activations wait on the host: what stays is outside them (embedding, head)
    # and one block's brought back during backward.
    assert offload.step.activations < 0.5 * kept.step.activations, (offload.step, kept.step)
    assert offload.step.total < kept.step.total, (offload.step, kept.step)
    print("offload", offload.step.describe(), offload.offloaded, "kept", kept.step.describe())


def test_offload_and_memory_budget_train_like_the_plain_run(debug_args, same_doc_dataset, tmp_path):
    base = [*fp32_args(debug_args, same_doc_dataset), "--training.steps", "2"]
    plain = train(_load(base))
    offload = train(
        _load(
            [
                *base,
                *("--job.dump_folder", str(tmp_path / "offload")),
                *("--activation_checkpoint.cpu_offload", "true"),
            ]
        )
    )
    # The same kernels; the saved tensors go to host memory and back unchanged.
    assert offload.losses == plain.losses
    budget = train(
        _load(
            [
                *base,
                *("--job.dump_folder", str(tmp_path / "budget")),
                *("--activation_checkpoint.mode", "memory_budget"),
                *("--activation_checkpoint.memory_budget", "0.3"),
                *("--compile.enable", "--compile.backend", "aot_eager"),
            ]
        )
    )
    # Compiled graphs (decomposed) round differently from eager kernels in float32.
    assert budget.losses == pytest.approx(plain.losses, abs=1e-4)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--training.dtype", "bfloat16", "--training.mixed_precision_param", "float32"], "set"),
        (["--activation_checkpoint.mode", "memory_budget"], "the model is not compiled"),
    ],
)
def test_mode_combinations_that_cannot_run_are_refused(debug_args, extra, says):
    try:  # a section's own check fails as the config loads, the others before the run
        problems, _, _ = preflight_problems(_load([*debug_args, *extra]), 1)
    except ConfigError as e:
        problems = e.problems
    assert any(says in p for p in problems), problems
    assert ConfigError(problems).render().startswith("titan: config error")
