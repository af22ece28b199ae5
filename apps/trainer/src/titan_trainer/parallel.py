"""How the trainer uses titan-parallel: parallelize and initialise the model, run one
microbatch forward and backward (with loss parallel, context parallel, pipeline schedules or
autocast as the layout needs), clip gradients over every mesh dimension, reduce the loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import titan_parallel as tp_lib
from titan_core import ParallelDims, get_logger

log = get_logger("parallel")

REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ParallelRuntime:
    config: object
    dims: ParallelDims
    device: torch.device
    dtype: torch.dtype
    seed: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: float = 0.0
    pipeline: object | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ build
    def parallelize_and_init(self, model: nn.Module) -> list[nn.Module]:
        cfg = self.config
        self.flops_per_token = model.flops_per_token(cfg.training.seq_len)
        fsdp_mp = self.dims.fsdp_enabled or self.dims.dp_replicate_enabled
        kwargs = dict(
            parallelism=cfg.parallelism,
            ac=cfg.activation_checkpoint,
            compile=cfg.compile,
            param_dtype=self.dtype if fsdp_mp else torch.float32,
            reduce_dtype=REDUCE_DTYPES[cfg.training.mixed_precision_reduce],
            cpu_offload=cfg.training.enable_cpu_offload,
        )
        parts = [tp_lib.parallelize(model, self.dims, model.tp_plan(), **kwargs)]
        for part in parts:
            part.to_empty(device="cpu" if cfg.training.enable_cpu_offload else self.device)
            tp_lib.init_weights_exact(part, self.seed)
            part.train()
        self.autocast = None if (fsdp_mp or self.dtype == torch.float32) else self.dtype
        return parts

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Loss of one microbatch (detached, times `scale`), gradients accumulated."""
        (model,) = parts
        with self._contexts():
            logits = model(inputs)
            loss = self.loss_fn(logits, labels) * scale
            loss.backward()
        return loss.detach()

    def eval_loss(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        (model,) = parts
        with self._contexts():
            return self.loss_fn(model(inputs), labels).detach()

    def _contexts(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(tp_lib.loss_context(self.dims, self.config.parallelism))
        if self.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
        return stack

    def clip_grad_norm(self, parts: list[nn.Module], max_norm: float) -> float:
        params = [p for part in parts for p in part.parameters()]
        norm = tp_lib.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(norm)

    def reduce_loss(self, loss: torch.Tensor) -> float:
        mesh = self.dims.mesh("dp_cp")
        return float(loss) if mesh is None else float(tp_lib.dist_mean(loss, mesh))


def build_parallel_runtime(config, dims, device, dtype, seed, loss_fn) -> ParallelRuntime:
    return ParallelRuntime(config, dims, device, dtype, seed, loss_fn)
