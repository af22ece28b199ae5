"""`[model] attention_backend`: which SDPA kernel runs the model's causal attention.

`default` leaves the choice to torch's dispatcher (its fixed priority). A named kernel is
checked on the job's device with this rank's attention shape before training, and refused
with the reason when it cannot run it. `auto` times forward + backward of every kernel that
runs the shape (titan-models' `choose_attention_backend`) on rank 0, at start-up, and every
rank uses rank 0's pick: the ranks run the same shape on the same kind of device, and one
choice keeps their numerics alike. The dry run builds the model without this step, so it
times nothing.

The shape is one rank's: the local batch (a pipeline microbatch under pipeline parallel), the
sequence after context parallel, the heads after tensor parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from titan_core import ConfigError, ParallelDims, any_rank, get_logger
from titan_models.attention_backend import (
    ATTENTION_BACKENDS,
    AttentionShape,
    SDPAChoice,
    attention_candidates,
    choose_attention_backend,
    runnable_choice,
)
from titan_trainer.config import JobConfig

log = get_logger("train")

# Context parallel's ring attention exchanges the keys and values of the fused kernels only
# (flash, memory-efficient, cuDNN; on a CPU flash): the math kernel would attend to the local
# shard alone.
RING_KERNELS = ("flash", "cudnn", "efficient")


def attention_shape(
    config: JobConfig, dims: ParallelDims, heads: tuple[int, int, int]
) -> AttentionShape:
    """This rank's causal attention in a training step, for the model's `heads` (query heads,
    key/value heads, head size: `TrainableModel.sdpa_heads`)."""
    batch = (
        config.parallelism.pipeline_parallel_microbatch_size
        if dims.pp_enabled
        else config.training.local_batch_size
    )
    query_heads, kv_heads, head_dim = heads
    return AttentionShape(
        batch=batch,
        heads=query_heads // dims.tp,
        kv_heads=kv_heads // dims.tp,
        seq=config.training.seq_len // dims.cp,
        head_dim=head_dim,
    )


def apply_attention_backend(
    config: JobConfig,
    parts: list[nn.Module],
    dims: ParallelDims,
    device: torch.device,
    dtype: torch.dtype,
) -> SDPAChoice | None:
    """Sets `[model] attention_backend` on every attention layer of this rank's `parts` (still
    on the meta device: nothing else holds memory yet); returns the kernel (None: torch's
    dispatch). A collective with `auto` or a named kernel: every rank calls it."""
    name = config.model.attention_backend
    if name == "default":
        return None
    shape = attention_shape(config, dims, parts[0].sdpa_heads())
    if name == "auto":
        choice = _agreed_fastest(shape, dtype, device, ring=dims.cp > 1)
    else:
        choice = _checked(name, shape, dtype, device)
    for part in parts:
        part.set_sdpa_backend(choice)
    return choice


def _checked(name: str, shape: AttentionShape, dtype, device) -> SDPAChoice:
    choice, why = runnable_choice(name, shape, dtype, device)
    if not any_rank(choice is None):
        log.info(
            "attention: %s for %s, %s on %s", choice.name, shape, _dtype_name(dtype), device.type
        )
        return choice
    raise ConfigError(
        f"[model] attention_backend = {name!r}: the {name} kernel cannot run this job's"
        f" attention ({shape}, {_dtype_name(dtype)}) on {device.type}"
        f" (torch {torch.__version__}): {why or 'it failed on another rank; see its log'}\n"
        "use attention_backend = 'auto' (the fastest kernel that runs it) or 'default'"
        " (torch's own choice)"
    )


def _agreed_fastest(shape: AttentionShape, dtype, device, *, ring: bool) -> SDPAChoice:
    """Rank 0 times the candidates; every rank gets its pick."""
    candidates = tuple(n for n in attention_candidates(device) if not ring or n in RING_KERNELS)
    options = [SDPAChoice(ATTENTION_BACKENDS[n], r) for n in candidates for r in (False, True)]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    pick, problem = -1, ""
    if not distributed or dist.get_rank() == 0:
        try:
            result = choose_attention_backend(
                shape.batch, shape.heads, shape.kv_heads, shape.seq, shape.head_dim,
                dtype, device, candidates=candidates,
            )  # fmt: skip
            pick = options.index(result.best)
            log.info(
                "attention: %s for %s, %s on %s (forward + backward, timed on rank 0: %s)",
                result.best.name,
                shape,
                _dtype_name(dtype),
                device.type,
                result.summary(),
            )
        except RuntimeError as error:
            problem = str(error)
    if distributed:
        pick = _broadcast_from_rank0(pick)
    if pick < 0:
        raise ConfigError(
            f"[model] attention_backend = 'auto': {problem or 'rank 0 found no kernel'}\n"
            "use attention_backend = 'default' (torch's own choice), or another shape"
        )
    return options[pick]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _broadcast_from_rank0(value: int) -> int:
    """`value` as rank 0 has it, on every rank of the default group (a tensor where the
    backend needs it: CPU for gloo, the accelerator for NCCL)."""
    if "gloo" in str(dist.get_backend()):
        where = torch.device("cpu")
    else:
        accelerator = torch.accelerator.current_accelerator()
        where = torch.device(accelerator.type, torch.accelerator.current_device_index())
    tensor = torch.tensor([value], device=where)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())
