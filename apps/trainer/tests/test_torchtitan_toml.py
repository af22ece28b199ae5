"""torchtitan's TOML files load here unchanged: the keys it knows and Titan does not implement
are named in one warning, its current names for Titan's keys are used, and names it used to
have are errors that say what to write instead."""

from __future__ import annotations

import logging

import pytest

from titan_core import ConfigError, load_config
from titan_trainer import torchtitan_keys
from titan_trainer.config import JobConfig

# Written the way torchtitan's llama3 debug config and its integration-test base config are:
# sections and keys as torchtitan names them, including ones Titan has no use for.
TORCHTITAN_STYLE = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "debugmodel"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0
steps = 10
dataset = "c4_test"

[training.dataloader]
num_workers = 0
persistent_workers = false

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
context_parallel_degree = 1
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1
expert_parallel_comm_backend = "standard"

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[compile]
enable = false
components = ["model", "loss"]

[debug]
seed = 42

[validation]
enable = false
"""


def test_a_torchtitan_style_toml_loads_with_one_warning_naming_the_unimplemented_keys(
    tmp_path, caplog
):
    path = tmp_path / "debug_model.toml"
    path.write_text(TORCHTITAN_STYLE)
    with caplog.at_level(logging.WARNING, logger="titan"):
        config = load_config(JobConfig, toml_path=path)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("titan")
    ]
    assert len(warnings) == 1, warnings
    for key in (
        "[metrics] disable_color_printing",
        "[parallelism] expert_parallel_comm_backend",
        "[training.dataloader] persistent_workers",
    ):
        assert key in warnings[0], warnings
    # torchtitan's worker count is Titan's too.
    assert config.training.dataloader.num_workers == 0
    assert config.training.seed == 42  # [debug] seed is torchtitan's name for training.seed
    # Implemented (experts split over the TP ranks; with TP off, 1 is what -1 means).
    assert config.parallelism.expert_tensor_parallel_degree == 1
    assert config.training.local_batch_size == 8 and config.lr_scheduler.decay_ratio == 0.8


def test_an_old_torchtitan_name_is_an_error_naming_the_new_key(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(
        "[training]\nbatch_size = 8\ncompile = true\n\n[float8]\nenable_fsdp_float8_all_gather = true\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(JobConfig, toml_path=path)
    text = str(e.value)
    assert (
        "[training] batch_size was renamed (from old.toml)" in text
        and "use training.local_batch_size" in text
    )
    assert "use compile.enable" in text
    assert "use quantize.linear.float8.enable_fsdp_float8_all_gather" in text


def test_setting_both_names_of_one_key_is_an_error(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("[debug]\nseed = 1\n\n[training]\nseed = 2\n")
    with pytest.raises(ConfigError, match="both debug.seed and training.seed are set"):
        load_config(JobConfig, toml_path=path)


def test_the_tables_do_not_shadow_titan_keys():
    from titan_core.config import iter_options

    ours = {name for name, *_ in iter_options(JobConfig)}
    assert not ours & torchtitan_keys.UNIMPLEMENTED
    assert not ours & set(torchtitan_keys.RENAMED)
    assert set(torchtitan_keys.ALIASES.values()) <= ours
    for new in torchtitan_keys.RENAMED.values():
        key = new.split()[0]
        if "." in key and not key.startswith("--"):
            assert key in ours or key == "model.converters", new
