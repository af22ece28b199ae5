"""Which config keys the trainer reads while it runs: `python key_usage.py OUT.json WORK_DIR`.

Every section of the loaded config is given a subclass that records each field read. Recording
starts after loading and checking (validation reads keys that may do nothing), then covers
five runs in this process: a dry run with suggestions, a short training run with every
optional feature on, a resume of it from an initial checkpoint, a step of Ranger21 with
bfloat16 states, and a step of Muon with parameter groups
and QK-Clip."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

READ: set[str] = set()
PAUSED = [0]  # reads while the whole config is dumped (to TOML, to a dict) do not count


def track(config, path: tuple[str, ...] = ()) -> None:
    """Record reads of every field of every section of `config`, in place."""
    names = {f.name for f in dataclasses.fields(config)}
    prefix = ".".join(path)

    base = type(config)

    class Tracked(base):
        def __getattribute__(self, name):
            if name in names and not PAUSED[0]:
                READ.add(f"{prefix}.{name}" if prefix else name)
            return super().__getattribute__(name)

        def __reduce_ex__(self, protocol):
            # Copies and pickles (the dry run sends the config to other processes) are plain.
            return _plain, (base, dict(object.__getattribute__(self, "__dict__")))

    Tracked.__name__ = type(config).__name__
    for f in dataclasses.fields(config):
        value = object.__getattribute__(config, f.name)
        if dataclasses.is_dataclass(value):
            track(value, (*path, f.name))
    config.__class__ = Tracked


def _plain(cls, state: dict):
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def paused(fn):
    def wrapper(*args, **kwargs):
        PAUSED[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            PAUSED[0] -= 1

    return wrapper


def main(out: str, work: str) -> None:
    from titan_core import init_logging, load_config
    from titan_trainer import train as train_module
    from titan_trainer import window as window_module
    from titan_trainer.config import JobConfig
    from titan_trainer.dry_run import dry_run
    from titan_trainer.dry_run.simulate import fork_simulations_from_here
    from titan_trainer.preflight import preflight_problems
    from titan_trainer.shipped import find_config_file
    from titan_trainer.train import train

    # Writing the resolved config reads every key; that is not using them.
    train_module.to_toml = paused(train_module.to_toml)
    window_module.config_to_dict = paused(window_module.config_to_dict)
    init_logging()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    common = [
        "--job.config_file",
        "debug_model",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
    ]
    # A two-item task short enough for the 64-token windows below.
    os.makedirs(work, exist_ok=True)
    with open(f"{work}/tiny.jsonl", "w") as f:
        f.write(
            '{"q": "1 + 1 =", "c": ["2", "3"], "a": 0}\n{"q": "2 + 2 =", "c": ["5", "4"], "a": 1}\n'
        )
    with open(f"{work}/tiny.toml", "w") as f:
        f.write('name = "tiny"\nkind = "multiple_choice"\ndata = "tiny.jsonl"\n')
        f.write('context = "{q}"\nchoices = "c"\ntarget = "a"\n')
    everything = [
        *common,
        "--job.dump_folder",
        f"{work}/a",
        "--job.print_config",
        "--model.converters",
        "quantize.linear.float8",
        "--quantize.linear.float8.emulate",
        "--quantize.linear.float8.auto_filter_small_kn",
        "--model.print_after_conversion",
        "--optimizer.implementation",
        "foreach",
        "--training.steps",
        "2",
        "--training.global_batch_size",
        "4",
        "--training.gc_freq",
        "1",
        "--training.seed",
        "3",
        "--training.bad_rows",
        "skip",
        "--training.dataloader.num_workers",
        "1",
        "--training.dataloader.prefetch_factor",
        "3",
        "--model.attn_mask_type",
        "block_causal",
        "--model.block_causal_impl",  # its CPU path: SDPA per document from cu_seqlens
        "varlen",
        "--lr_scheduler.decay_ratio",
        "0.5",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
        "--activation_checkpoint.preserve_rng_state",
        "--compile.enable",
        "--compile.components",
        "loss",
        "--compile.backend",
        "aot_eager",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "1",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.async_executor",
        "thread",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--checkpoint.hf_interval",
        "1",
        "--checkpoint.hf_keep_latest_k",
        "1",
        "--checkpoint.hf_save_optimizer",
        "--validation.enable",
        "--validation.freq",
        "1",
        "--validation.steps",
        "1",
        "--validation.local_batch_size",
        "2",
        "--eval.tasks",
        f"{work}/tiny.toml",
        "--eval.freq",
        "3",  # not a step of this 2-step run: at_end scores the last
        "--eval.at_end",
        "--eval.max_examples",
        "2",
        "--eval.local_batch_size",
        "2",
        "--eval.add_bos",
        "false",
        "--eval.log_samples",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "1",
        "--profiling.enable_memory_snapshot",
        "--metrics.enable_wandb",
        "--metrics.peak_tflops",
        "1",
    ]
    runs = [
        everything,
        [
            *common,
            "--job.dump_folder",
            f"{work}/b",
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            f"{work}/a/checkpoint/step-2",
            "--checkpoint.initial_load_model_only",
            "false",
            "--checkpoint.exclude_from_loading",
            "dataloader",
            "--metrics.enable_tensorboard",
            "false",
        ],
        [
            *common,
            "--job.dump_folder",
            f"{work}/r",
            "--training.steps",
            "1",
            "--optimizer.name",
            "Ranger21",
            "--optimizer.state_dtype",
            "bfloat16",
            "--metrics.enable_tensorboard",
            "false",
        ],
        [
            *common,
            "--job.dump_folder",
            f"{work}/m",
            "--training.steps",
            "1",
            "--optimizer.name",
            "Muon",
            "--optimizer.muon.lr",
            "0.02",
            "--optimizer.muon.qk_clip_tau",
            "100",
            "--optimizer.param_groups",
            '[{"params": "norm", "weight_decay": 0}]',
            "--metrics.enable_tensorboard",
            "false",
        ],
    ]
    config = load_config(
        JobConfig,
        [
            *common,
            "--job.dump_folder",
            f"{work}/c",
            "--comm.mode",
            "fake_backend",
            "--dry_run.device_memory_gib",
            "0.01",
            "--dry_run.headroom_gib",
            "0",
            "--dry_run.all_ranks",
            "--dry_run.suggest",
            "false",
        ],
        find_config_file=find_config_file,
    )
    track(config)
    # First, while nothing has run in this process: its simulation forks from here, as
    # `titan-train --dry-run`'s does (a server process would import torch a second time).
    fork_simulations_from_here()
    dry_run(config, out=lambda text: None)
    for args in runs:
        config = load_config(JobConfig, args, find_config_file=find_config_file)
        problems, _, _ = preflight_problems(config, 1)
        assert not problems, problems
        track(config)
        train(config)
    with open(out, "w") as f:
        json.dump(sorted(READ), f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
