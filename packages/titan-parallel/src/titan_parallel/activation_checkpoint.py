"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

Modes (the [activation_checkpoint] section):
- `none`: store everything.
- `full`: every block is checkpointed; only its input is kept.
- `selective` with `selective_ac_option = "k"`: every k-th block is checkpointed fully.
- `selective` with `"op"`: every block is checkpointed, but the outputs of the expensive ops
  in `SAVE_OPS` (matmuls, attention kernels, TP's reduce-scatter/all-reduce, expert parallel's
  all-to-all) are kept, so
  backward recomputes only the cheap element-wise work. All of them are kept, not every other
  matmul as torchtitan does: that uses more memory than torchtitan's policy but needs no
  per-forward counting, and the recomputation cost is the smallest possible.

- `memory_budget`: nothing is wrapped; the compiler's partitioner keeps at most
  `memory_budget` of each compiled block's activations and recomputes the cheapest rest
  (torch.compile's `activation_memory_budget`, a process-wide setting, so one budget per
  process). Needs the blocks compiled.

With `cpu_offload`, each block (checkpointed or not) is then wrapped to keep what autograd
saves in host memory (see `titan_parallel.activation_offload`).

Checkpointed blocks are wrapped in place (`model.layers[name]` becomes a `CheckpointWrapper`);
their `state_dict` keys are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_core.config import ConfigError
from titan_parallel.activation_offload import apply_activation_offload
from titan_parallel.config import ActivationCheckpoint


def _ops(*names: str) -> set:
    ops = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:  # some kernels exist only in some builds
            ops.add(getattr(packet, overload))
    return ops


SAVE_OPS = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.all_to_all_single.default",
)
"""Ops whose outputs selective `op` checkpointing keeps instead of recomputing."""


# Profiler annotations (record_function) are not computations: replay them as they come. FSDP's
# hooks of expert-parallel experts run inside a checkpointed block and annotate a different
# number of times in forward and in recomputation, which SAC would take for a mismatch.
torch.utils.checkpoint.SAC_IGNORED_OPS.update(
    _ops(
        "profiler._record_function_enter.default",
        "profiler._record_function_enter_new.default",
        "profiler._record_function_exit.default",
        "profiler._record_function_exit._RecordFunction",
    )
)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    return create_selective_checkpoint_contexts(_policy)


def apply_ac(model: nn.Module, ac: ActivationCheckpoint) -> None:
    """Wrap the blocks of `model.layers` for activation checkpointing as `ac` says (in place)."""
    problems = ac.validate()
    if problems:
        raise ConfigError(problems)
    if ac.mode == "memory_budget":
        _set_memory_budget(ac.memory_budget)
    elif ac.mode != "none":
        _wrap_checkpointed(model, ac)
    if ac.cpu_offload:
        apply_activation_offload(model)


def _set_memory_budget(budget: float) -> None:
    from torch._functorch import config

    # Read when a block compiles (at its first call), so the value must stay set.
    config.activation_memory_budget = budget


def _wrap_checkpointed(model: nn.Module, ac: ActivationCheckpoint) -> None:
    layers: nn.ModuleDict = model.layers
    every = 1
    kwargs: dict = {"preserve_rng_state": ac.preserve_rng_state}
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        kwargs["context_fn"] = _op_context
    elif ac.mode == "selective":
        every = int(ac.selective_ac_option)
    for i, (name, block) in enumerate(list(layers.items())):
        if (i + 1) % every == 0:
            layers[name] = checkpoint_wrapper(block, **kwargs)
