"""The parallel runtime of one layout, the one object the run passes around: how its model is
built (`ModelParallelizer`, `titan_trainer.parallel`), how a microbatch runs through it
(`MicrobatchRunner`, `titan_trainer.forward`) and what a step reduces over the ranks
(`titan_trainer.reductions`), each its own module; this class only puts them together."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import titan_parallel
from titan_core import ParallelDims
from titan_trainer import reductions
from titan_trainer.forward import MicrobatchRunner
from titan_trainer.loss import with_mtp
from titan_trainer.parallel import ModelParallelizer, ParallelSettings


class ParallelRuntime:
    """`parallelizer` builds the parts, `runner` runs microbatches through them."""

    def __init__(self, parallelizer: ModelParallelizer) -> None:
        self.parallelizer = parallelizer
        self.runner = MicrobatchRunner(parallelizer)
        self.dims, self.device, self.dtype = (
            parallelizer.dims,
            parallelizer.device,
            parallelizer.dtype,
        )

    @classmethod
    def of(
        cls,
        config,
        dims: ParallelDims,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> ParallelRuntime:
        """The runtime for `config`'s parallel settings on this rank's mesh and device."""
        settings = ParallelSettings.of(config)
        return cls(ModelParallelizer(settings, dims, device, dtype, seed=seed, loss_fn=loss_fn))

    # Building (ModelParallelizer).
    def parallelize(self, model: nn.Module, stage_io=None) -> list[nn.Module]:
        return self.parallelizer.parallelize(model, stage_io, loss_fn=self.runner.scaled_loss)

    def parallelize_part(self, part: nn.Module) -> None:
        self.parallelizer.parallelize_part(part)

    def materialize(self, parts: list[nn.Module]) -> None:
        self.parallelizer.materialize(parts)

    def init_weights(self, parts: list[nn.Module], *, parameters: bool = True) -> None:
        self.parallelizer.init_weights(parts, parameters=parameters)

    @property
    def pipeline(self) -> titan_parallel.Pipeline | None:
        return self.parallelizer.form.pipeline

    @property
    def flops_per_token(self) -> float:
        return self.parallelizer.form.flops_per_token

    @property
    def autocast(self) -> torch.dtype | None:
        return self.parallelizer.form.autocast

    @autocast.setter
    def autocast(self, dtype: torch.dtype | None) -> None:  # a benchmark's own FSDP sets it
        self.parallelizer.form.autocast = dtype

    # Running microbatches (MicrobatchRunner).
    @property
    def document_start_id(self) -> int | None:
        return self.runner.document_start_id

    @document_start_id.setter
    def document_start_id(self, token: int | None) -> None:
        self.runner.document_start_id = token

    def forward_backward(self, parts, inputs, labels, scale: float, *, mark=None) -> torch.Tensor:
        return self.runner.forward_backward(parts, inputs, labels, scale, mark=mark)

    def eval_loss(self, parts, inputs, labels) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.eval_loss(parts, inputs, labels)

    def eval_rows(self, parts, inputs, labels) -> torch.Tensor:
        return self.runner.eval_rows(parts, inputs, labels)

    # Reductions over the ranks (titan_trainer.reductions).
    def clip_grad_norm(self, parts: list[nn.Module], max_norm: float) -> torch.Tensor:
        return reductions.clip_grad_norm(parts, max_norm, self.dims)

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return reductions.reduce_sum(values, self.dims)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return reductions.reduce_loss(loss, self.dims)


def build_parallel_runtime(config, dims, device, dtype, seed, loss_fn) -> ParallelRuntime:
    """The runtime for this layout; the loss is compiled when [compile] lists "loss", and
    takes a multi-token-prediction model's logits of every depth (`titan_trainer.loss`)."""
    compiled = titan_parallel.compile_loss(loss_fn, config.compile)
    return ParallelRuntime.of(
        config, dims, device, dtype, seed, with_mtp(compiled, config.training.mtp_loss_weight)
    )
