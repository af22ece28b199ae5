"""DeepSeek-V3 and Llama 4 through the trainer's command: a checkpoint saved on one layout
resumes on another and continues with the first run's losses (the expert biases, optimizer
and schedule included); the layouts the models cannot take are refused before start-up. The
README's commands that train their debug configs run in test_readme_commands.py."""

from __future__ import annotations

import shutil

import pytest
from conftest import TRAINER, parse_losses, run_cli

PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
       "1", "--parallelism.pipeline_parallel_microbatch_size", "2"]  # fmt: skip
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
RESHARDS = {
    # family: (the saving layout: processes, local batch, options; the resuming one)
    "deepseek_v3": ((2, 4, PP2), (1, 4, [])),
    "llama4": ((2, 2, FSDP2), (1, 4, [])),
}


def _args(family: str, folder, dataset: str, local_batch: int, *extra: str) -> list[str]:
    return [
        *("--job.config_file", str(TRAINER / "configs" / f"{family}_debug.toml")),
        *("--job.dump_folder", str(folder), "--training.dataset", dataset),
        # seq 128: each window is exactly one copy of the document (see conftest.TEXT).
        *("--training.seq_len", "128", "--training.local_batch_size", str(local_batch)),
        *("--training.steps", "4", "--training.mixed_precision_param", "float32"),
        *("--lr_scheduler.warmup_steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"),
        # Every sample is the same document: the data cannot depend on the layout, and the
        # loader's position (kept per data-parallel rank) is not carried over.
        *("--checkpoint.exclude_from_loading", "dataloader"),
        *("--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1"),
        *("--metrics.peak_tflops", "1", "--metrics.save_plots_folder", ""),
        *extra,
    ]


@pytest.mark.parametrize("family", list(RESHARDS))
def test_a_checkpoint_resumes_on_another_layout_with_the_same_losses(
    family, tmp_path, same_doc_dataset
):
    (nproc, batch, layout), (nproc_again, batch_again, layout_again) = RESHARDS[family]
    first = tmp_path / "first"
    result = run_cli(_args(family, first, same_doc_dataset, batch, *layout), nproc=nproc)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    whole = parse_losses(result.stdout)
    assert sorted(whole) == [1, 2, 3, 4]
    again = tmp_path / "again"
    (again / "checkpoint").mkdir(parents=True)
    shutil.copytree(first / "checkpoint" / "step-2", again / "checkpoint" / "step-2")
    result = run_cli(
        _args(family, again, same_doc_dataset, batch_again, *layout_again), nproc=nproc_again
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed at step 2" in result.stdout
    resumed = parse_losses(result.stdout)
    assert sorted(resumed) == [3, 4]
    for step, loss in resumed.items():
        # fp32; the layouts sum in other orders (~1e-6 relative); the log prints 4 decimals.
        assert loss == pytest.approx(whole[step], abs=2e-4), (step, whole, resumed)
    # The comparison covers moving weights: the same document is being learnt.
    assert whole[4] < whole[1] - 0.5, whole


def test_llama4_context_parallel_beyond_one_attention_chunk_is_refused_before_start():
    from titan_trainer.config import JobConfig
    from titan_trainer.preflight import preflight_problems

    config = JobConfig()
    config.model.name, config.model.flavor = "llama4", "debugmodel"  # chunks of 64
    config.parallelism.context_parallel_degree = 2
    config.training.seq_len = 128
    problems, _, _ = preflight_problems(config, 2)
    assert any(
        "context_parallel_degree = 2: Llama 4 under context parallel needs the sequence (128)"
        " to fit in one attention chunk (64)" in p
        for p in problems
    ), problems
    config.training.seq_len = 64
    problems, _, _ = preflight_problems(config, 2)
    assert not any("context_parallel" in p for p in problems), problems
