"""torch.compile for Titan models: each block separately, so that one compiled graph serves
every block of the same shape and compile time stays flat as the model grows."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from titan_parallel.activation_offload import OffloadWrapper
from titan_parallel.config import Compile


def apply_compile(model: nn.Module, compile: Compile) -> None:
    """Compile each block of `model.layers` in place (`nn.Module.compile`, so parameter names
    stay unchanged) with `fullgraph=True`: a graph break inside a block is an error to fix,
    not a silent slowdown (blocks with expert-parallel experts excepted: the token exchange
    runs eagerly between graphs). Does nothing unless `compile.enable` and "model" is a
    component.

    Apply it after tensor parallel and activation checkpointing and before FSDP, so that
    FSDP's hooks run outside the compiled graph.
    """
    if not compile.compiles("model"):
        return
    _run_side_effects_once_under_checkpoint()
    for block in model.layers.values():
        # Activation offload's saved-tensor hooks are set around the compiled block, where
        # they see what the compiled forward saves; dynamo does not trace them.
        if isinstance(block, OffloadWrapper):
            block = block._checkpoint_wrapped_module
        # Expert parallel's token exchange reads split sizes on the host and runs outside
        # the graph: a block holding it is compiled in the pieces around it.
        whole = not any(hasattr(m, "_titan_expert_shards") for m in block.modules())
        block.compile(backend=compile.backend, fullgraph=whole)


def _run_side_effects_once_under_checkpoint() -> None:
    # Activation checkpointing replays a block's forward in backward, and eager code replays
    # its Python side effects with it (a MoE layer's token counts and auxiliary loss); compiled
    # code cannot, and dynamo refuses such a checkpointed block unless told that they may run
    # once (torch >= 2.10 has the switch).
    config = torch._dynamo.config
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def compile_loss(loss_fn: Callable, compile: Compile) -> Callable:
    """`loss_fn` compiled when compile is on with "loss" among its components, else unchanged."""
    if not compile.compiles("loss"):
        return loss_fn
    return torch.compile(loss_fn, backend=compile.backend)
