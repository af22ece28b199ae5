"""Qwen3's mixture-of-experts debug config through the trainer, under every layout that splits
experts (the README's command, which trains it and reports the experts' load, runs in
test_readme_commands.py): FSDP over 2 processes, expert parallel over 2 (EP2), the MoE layers
under tensor parallel (TP2, compiled), and an EP2 checkpoint resumed on 1 process and on EP2 x FSDP2
(4 processes) take the steps one process takes. fp32; every sample is the same document, so
that sharding the data changes no batch and the data position needs no carrying over.

The runs share the machine: the first four start together, then the two resumed runs.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import TRAINER, parse_losses, start_cli

CONFIG = str(TRAINER / "configs" / "qwen3_moe_debug.toml")
STEPS = 4
EP2 = ["--parallelism.expert_parallel_degree", "2"]


def _args(folder, dataset: str, local_batch: int, *extra: str) -> list[str]:
    return ["--job.config_file", CONFIG, "--job.dump_folder", str(folder),
            "--metrics.log_freq", "1", "--metrics.save_plots_folder", "",
            "--training.seq_len", "128", "--training.dataset", dataset,
            "--training.steps", str(STEPS), "--training.local_batch_size", str(local_batch),
            "--training.mixed_precision_param", "float32", "--lr_scheduler.warmup_steps", "2",
            "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "--checkpoint.interval", "2",
            # The loader's position is kept per data-parallel rank; with one document
            # everywhere there is nothing to carry over between layouts.
            "--checkpoint.exclude_from_loading", "dataloader", *extra]  # fmt: skip


def _validation(dataset: str) -> list[str]:
    # The same document again: its loss cannot depend on how the samples are split.
    return ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
            "--validation.dataset", dataset, "--validation.local_batch_size", "2"]  # fmt: skip


def _resumed_from(ep2_folder, folder):
    (folder / "checkpoint").mkdir(parents=True)
    shutil.copytree(ep2_folder / "checkpoint" / "step-2", folder / "checkpoint" / "step-2")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, same_doc_dataset) -> dict:
    tmp = tmp_path_factory.mktemp("moe")
    data = same_doc_dataset
    # Global batch 4 everywhere: local batch 4 / (data-parallel ranks).
    first = {
        "one_process": start_cli(_args(tmp / "one", data, 4, *_validation(data))),
        "fsdp2": start_cli(_args(tmp / "fsdp2", data, 2), nproc=2),
        "ep2": start_cli(_args(tmp / "ep2", data, 2, *EP2, *_validation(data)), nproc=2),
        # Compiled too (aot_eager: the same ops, so the same fp32 numbers): the MoE block
        # under TP is one graph (fullgraph).
        "tp2": start_cli(
            _args(
                tmp / "tp2",
                data,
                4,
                "--parallelism.tensor_parallel_degree",
                "2",
                "--compile.enable",
                "true",
                "--compile.backend",
                "aot_eager",
                "--compile.components",
                "model",
            ),
            nproc=2,
        ),  # fmt: skip
    }
    out = {name: run.result(900) for name, run in first.items()}
    if out["ep2"].returncode == 0:
        second = {
            "ep2_resumed_on_one_process": start_cli(
                _args(_resumed_from(tmp / "ep2", tmp / "r1"), data, 4)
            ),
            "ep2_resumed_on_ep2_x_fsdp2": start_cli(
                _args(_resumed_from(tmp / "ep2", tmp / "r4"), data, 1, *EP2), nproc=4
            ),
        }
        out |= {name: run.result(900) for name, run in second.items()}
    # The tests read the runs' output only; their checkpoints (1.1 GiB) would hold the disk
    # until the session ends.
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def _losses(result) -> dict[int, float]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return parse_losses(result.stdout)


@pytest.mark.parametrize(
    "layout, steps",
    [
        ("fsdp2", [1, 2, 3, 4]),
        ("ep2", [1, 2, 3, 4]),
        ("tp2", [1, 2, 3, 4]),
        ("ep2_resumed_on_one_process", [3, 4]),
        ("ep2_resumed_on_ep2_x_fsdp2", [3, 4]),
    ],
)
def test_layout_takes_the_steps_of_one_process(layout, steps, runs):
    want, got = _losses(runs["one_process"]), _losses(runs[layout])
    assert sorted(got) == steps, got
    for step in steps:
        # The log prints 4 decimals; fp32 sums in another order differ by ~1e-6 relative.
        assert abs(got[step] - want[step]) <= 2e-4, (step, got, want)
    print(f"\n{layout}: largest loss difference {max(abs(got[s] - want[s]) for s in steps):.4f}")
    if layout in ("ep2", "ep2_resumed_on_ep2_x_fsdp2"):
        assert "(ep 2)" in runs[layout].stdout  # the layout line names expert parallel
    if "resumed" in layout:
        assert "resumed at step 2" in runs[layout].stdout


def test_validation_under_expert_parallel_matches_one_process(runs):
    def losses(result) -> dict[int, float]:
        return {
            int(line.split("step")[1].split("|")[0]): float(line.split("validation loss")[1])
            for line in result.stdout.splitlines()
            if "| validation loss" in line
        }

    want, got = losses(runs["one_process"]), losses(runs["ep2"])
    assert sorted(want) == sorted(got) == [2, 4], (want, got)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 2e-4, (step, got, want)  # printed to 4 decimals


def test_expert_load_is_reported_alike_on_every_layout(runs):
    """max/mean tokens per expert, from the counts of every rank: the same routing, the same
    number on every layout."""

    def loads(result) -> list[str]:
        return [line.split("experts max/mean")[1].strip() for line in result.stdout.splitlines() if "experts max/mean" in line]  # fmt: skip

    want = loads(runs["one_process"])
    assert len(want) == STEPS
    for layout in ("fsdp2", "ep2", "tp2"):
        assert loads(runs[layout]) == want, layout


def test_layouts_that_cannot_split_experts_are_refused_before_start():
    from titan_core import ConfigError
    from titan_trainer.checks import check_config
    from titan_trainer.config import JobConfig

    def refused(world: int, **parallelism) -> str:
        config = JobConfig()
        config.model.name, config.model.flavor = "qwen3", "debugmodel_moe"
        for key, value in parallelism.items():
            setattr(config.parallelism, key, value)
        with pytest.raises(ConfigError) as e:
            check_config(config, world)
        return str(e.value)

    # 8 experts do not split over 3 ranks.
    message = refused(3, expert_parallel_degree=3)
    assert (
        "expert_parallel_degree = 3 does not divide the 8 experts of layers.0.feed_forward"
        in message
    )
    # EP borrows data-parallel ranks: 2 x TP 2 leaves one.
    message = refused(4, expert_parallel_degree=4, tensor_parallel_degree=2)
    assert "must divide data_parallel_shard x context_parallel = 2" in message
    # Titan splits experts over TP: ETP must follow it.
    message = refused(2, tensor_parallel_degree=2, expert_tensor_parallel_degree=1)
    assert "set expert_tensor_parallel_degree = 2 (or -1" in message
    # A dense model has no experts to split; it ignores the expert TP degree (torchtitan's
    # dense configs set it to 1 with TP on).
    config = JobConfig()
    config.model.name, config.model.flavor = "qwen3", "debugmodel"
    config.parallelism.tensor_parallel_degree = 2
    config.parallelism.expert_tensor_parallel_degree = 1
    check_config(config, 2)
    config.parallelism.tensor_parallel_degree = 1
    config.parallelism.expert_parallel_degree = 2
    with pytest.raises(ConfigError, match="has no MoE layer"):
        check_config(config, 2)
    # What works: EP with TP, ETP following TP.
    config.model.flavor = "debugmodel_moe"
    config.parallelism.tensor_parallel_degree = 2
    config.parallelism.expert_tensor_parallel_degree = 2
    check_config(config, 4)
