"""torchtitan's config keys that Titan treats specially, so that a torchtitan TOML loads here
unchanged (read from torchtitan's `JobConfig` as of its last TOML-based release, February
2026, and the names its earlier releases used).

- `ALIASES`: torchtitan's name for a key Titan has under another name; the value is used.
- `UNIMPLEMENTED`: keys torchtitan knows and Titan does not implement; a file that sets them
  loads, with one warning line naming them.
- `RENAMED`: names torchtitan used before and later renamed; setting one is an error that
  names the key to use instead.
- `VALUES`: torchtitan's older names of values (its converter `float8`); read as Titan's,
  with a one-line notice.

Handled where their meaning lives: `filter_fqns = ["auto_filter_small_kn"]` (torchtitan's
switch; titan-float8's section), `dataset = "c4_test"` / `"c4_validation"` (titan-data's
dataset names), `hf_assets_path` next to `tokenizer_path` (`Model.tokenizer_source`).
"""

from __future__ import annotations

ALIASES: dict[str, str] = {
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
}

UNIMPLEMENTED: frozenset[str] = frozenset(
    {
        "activation_checkpoint.debug",
        "activation_checkpoint.determinism_check",
        "activation_checkpoint.early_stop",
        "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
        "activation_checkpoint.visualize_memory_budget_pareto",
        "checkpoint.enable_first_step_checkpoint",
        "checkpoint.enable_ft_dataloader_checkpoints",
        "checkpoint.initial_load_in_hf_quantized",
        "checkpoint.load_only",
        "comm.save_traces_file_prefix",
        "comm.save_traces_folder",
        "debug.deterministic_warn_only",
        "debug.moe_force_load_balance",
        "experimental.custom_args_module",
        "experimental.custom_import",
        "fault_tolerance.process_group",
        # torchtitan's fault-tolerance module (job.custom_config_module): streaming DiLoCo's
        # fragments, which Titan's DiLoCo does not split the model into.
        "fault_tolerance.fragment_sync_delay",
        "fault_tolerance.fragment_update_alpha",
        "fault_tolerance.module_fqns_per_model_fragment",
        "fault_tolerance.num_fragments",
        "fault_tolerance.should_quantize",
        "job.custom_config_module",
        "job.save_config_file",
        "lr_scheduler.total_steps",
        "memory_estimation.disable_fake_mode",
        "memory_estimation.enable",
        "metrics.disable_color_printing",
        "metrics.save_for_all_ranks",
        "optimizer.early_step_in_backward",
        "parallelism.context_parallel_load_balancer",
        "parallelism.expert_parallel_comm_backend",
        "parallelism.pipeline_parallel_expert_parallel_overlap",
        "profiling.profiler_active",
        "profiling.profiler_warmup",
        "quantize.grouped_mm.float8.fqns",
        "quantize.grouped_mm.mx.fqns",
        "quantize.grouped_mm.mx.recipe_name",
        "quantize.linear.mx.filter_fqns",
        "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        "quantize.linear.mx.recipe_name",
        "training.dataloader.persistent_workers",
        "training.gc_debug",
        "validation.dataloader.num_workers",
        "validation.dataloader.persistent_workers",
        "validation.dataloader.pin_memory",
        "validation.dataloader.prefetch_factor",
    }
)

_FLOAT8 = "quantize.linear.float8"
RENAMED: dict[str, str] = {
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.model_weights_only": "checkpoint.last_save_model_only",
    "experimental.context_parallel_degree": "parallelism.context_parallel_degree",
    "experimental.context_parallel_rotate_method": "parallelism.context_parallel_rotate_method",
    "experimental.enable_async_tensor_parallel": "parallelism.enable_async_tensor_parallel",
    "experimental.pipeline_parallel_degree": "parallelism.pipeline_parallel_degree",
    "experimental.pipeline_parallel_microbatches": "parallelism.pipeline_parallel_microbatch_size (samples per microbatch, not a count)",
    "experimental.pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "experimental.pipeline_parallel_schedule_csv": "parallelism.pipeline_parallel_schedule_csv",
    "experimental.pipeline_parallel_split_points": "parallelism.module_fqns_per_model_part",
    "parallelism.pipeline_parallel_split_points": "parallelism.module_fqns_per_model_part",
    "float8.emulate": f"{_FLOAT8}.emulate",
    "float8.enable_fsdp_float8_all_gather": f"{_FLOAT8}.enable_fsdp_float8_all_gather",
    "float8.filter_fqns": f"{_FLOAT8}.filter_fqns",
    "float8.precompute_float8_dynamic_scale_for_fsdp": f"{_FLOAT8}.precompute_float8_dynamic_scale_for_fsdp",
    "float8.recipe_name": f"{_FLOAT8}.recipe_name",
    "float8.enable_float8_linear": f'model.converters = ["{_FLOAT8}"]',
    "training.fp8_linear": f'model.converters = ["{_FLOAT8}"]',
    "job.print_args": "job.print_config",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "memory_estimation.enabled": '--dry-run (or comm.mode = "fake_backend")',
    "metrics.enable_color_printing": "nothing (Titan does not color its output)",
    "optimizer.fused": 'optimizer.implementation = "fused"',
    "training.batch_size": "training.local_batch_size",
    "training.compile": "compile.enable",
    "training.data_parallel_degree": "parallelism.data_parallel_shard_degree",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.disable_loss_parallel": "parallelism.disable_loss_parallel",
    "training.enable_loss_parallel": "parallelism.disable_loss_parallel (inverted)",
    "training.fsdp_reshard_after_forward": "parallelism.fsdp_reshard_after_forward",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "training.warmup_steps": "lr_scheduler.warmup_steps",
    "validation.enabled": "validation.enable",
}

VALUES: dict[str, dict[str, str]] = {
    # torchtitan's converter registry named Float8 `float8` before it became
    # `quantize.linear.float8` (its 405B config still says `float8`).
    "model.converters": {"float8": _FLOAT8},
}
