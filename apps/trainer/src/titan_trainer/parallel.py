"""How the trainer uses titan-parallel: split into pipeline stages, parallelize and initialise,
run one microbatch forward and backward (with loss parallel, context parallel, a pipeline
schedule or autocast as the layout needs), clip gradients over every mesh dimension, reduce
the loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

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
    pipeline: tp_lib.Pipeline | None = field(default=None, repr=False)
    autocast: torch.dtype | None = None
    _scale: float = 1.0

    # ------------------------------------------------------------------ build
    def parallelize_and_init(self, model: nn.Module) -> list[nn.Module]:
        """Pipeline split (if PP), then TP -> AC -> compile -> FSDP on each part, then
        materialise and initialise. Returns this rank's model parts."""
        cfg = self.config
        p = cfg.parallelism
        self.flops_per_token = model.flops_per_token(cfg.training.seq_len)
        fsdp_mp = self.dims.fsdp_enabled or self.dims.dp_replicate_enabled
        if self.dims.pp_enabled:
            self.pipeline = tp_lib.build_pipeline(
                model,
                self.dims.mesh("pp"),
                schedule=p.pipeline_parallel_schedule,
                microbatch_size=p.pipeline_parallel_microbatch_size,
                local_batch_size=cfg.training.local_batch_size,
                loss_fn=self._scaled_loss,
                device=self.device,
                layers_per_stage=p.pipeline_parallel_layers_per_stage,
                first_stage_less_layers=p.pipeline_parallel_first_stage_less_layers,
                last_stage_less_layers=p.pipeline_parallel_last_stage_less_layers,
                split_points=p.module_fqns_per_model_part,
                csv_path=p.pipeline_parallel_schedule_csv or None,
                seq_len=cfg.training.seq_len,
            )
            parts = self.pipeline.model_parts
        else:
            parts = [model]
        for part in parts:
            tp_lib.parallelize(
                part,
                self.dims,
                part.tp_plan() if self.dims.tp_enabled else None,
                parallelism=p,
                ac=cfg.activation_checkpoint,
                compile=cfg.compile,
                param_dtype=self.dtype if fsdp_mp else torch.float32,
                reduce_dtype=REDUCE_DTYPES[cfg.training.mixed_precision_reduce],
                cpu_offload=cfg.training.enable_cpu_offload,
            )
            part.to_empty(device="cpu" if cfg.training.enable_cpu_offload else self.device)
            # Exact: every layout starts from the weights a single process would draw. Pipeline
            # stages draw only their own modules; a seed checkpoint makes them match too.
            tp_lib.init_weights_exact(part, self.seed, buffer_device=self.device)
            part.train()
        self.autocast = None if (fsdp_mp or self.dtype == torch.float32) else self.dtype
        if self.dims.cp_enabled:
            tp_lib.enable_cpu_ring_attention()
        return parts

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self._scale

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Loss of one microbatch times `scale` (detached); gradients accumulate."""
        self._scale = scale
        inputs, labels = self._own_batch(inputs, labels)
        with self._contexts(parts, inputs, labels):
            if self.pipeline is not None:
                loss = self.pipeline.step(inputs, labels)
                return tp_lib.broadcast_pipeline_loss(loss, self.dims.mesh("pp"), self.device)
            (model,) = parts
            loss = self._scaled_loss(model(inputs), labels)
            loss.backward()
        return _plain(loss.detach())

    def eval_loss(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        (model,) = parts
        inputs, labels = self._own_batch(inputs, labels)
        with torch.no_grad(), self._contexts(parts, inputs, labels):
            return _plain(self.loss_fn(model(inputs), labels).detach())

    def _own_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # CP shards the batch in place; the loader's inputs and labels are two views of one
        # packed window, so each needs memory of its own first.
        if not self.dims.cp_enabled:
            return inputs, labels
        return tuple(t.clone(memory_format=torch.contiguous_format) for t in (inputs, labels))

    def _contexts(self, parts, inputs, labels) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.dims.cp_enabled:
            # Shard the batch and each part's rope table along the sequence for this step.
            ropes = [part.rope_cache for part in parts]
            stack.enter_context(
                tp_lib.cp_context(
                    self.dims.mesh("cp"),
                    [inputs, labels, *ropes],
                    [1, 1, *([0] * len(ropes))],
                    {inputs, labels},
                    rotate_method=self.config.parallelism.context_parallel_rotate_method,
                )
            )
        stack.enter_context(tp_lib.loss_context(self.dims, self.config.parallelism))
        if self.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
        return stack

    def clip_grad_norm(self, parts: list[nn.Module], max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping, left on the device (no read-back)."""
        params = [p for part in parts for p in part.parameters()]
        return tp_lib.clip_grad_norm_(
            params, max_norm if max_norm > 0 else float("inf"), pp_mesh=self.dims.mesh("pp")
        )

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of `loss` over the data-parallel and context-parallel ranks, as a tensor on
        the device: an all-reduce, but no read-back to the host."""
        loss = loss.detach().float()
        mesh = self.dims.mesh("dp_cp")
        if mesh is None:
            return loss
        if mesh.device_type != "cpu" and loss.device.type == "cpu":
            loss = loss.to(mesh.device_type)
        # Sum then divide: gloo has no average reduction.
        return funcol.all_reduce(loss, reduceOp="sum", group=mesh) / mesh.size()


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel returns a replicated DTensor; the step's sum wants a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def build_parallel_runtime(config, dims, device, dtype, seed, loss_fn) -> ParallelRuntime:
    return ParallelRuntime(config, dims, device, dtype, seed, loss_fn)
