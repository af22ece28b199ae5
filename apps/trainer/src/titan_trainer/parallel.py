"""How the trainer parallelizes its model with titan-parallel: split into pipeline stages, then
tensor parallel, activation checkpointing, compile and FSDP on each part, give the parts
storage and their initial values. What that leaves for running a microbatch (the pipeline
schedule, the loss, autocast, the sequence-indexed buffers) is the `ParallelForm`, which
`titan_trainer.forward` runs; `titan_trainer.runtime` puts the two together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import titan_parallel
from titan_core import ConfigError, ParallelDims, get_logger
from titan_trainer.precision import DTYPES, cast_parameters_

log = get_logger("parallel")


@dataclass(frozen=True)
class ParallelSettings:
    """The config sections the parallel runtime reads, by name (read when used: a caller may
    change a section before the model is built)."""

    training: object
    """`[training]`: sequence length, local batch, dtypes, CPU offload, loss chunks."""
    parallelism: object
    """`[parallelism]` (titan-parallel's `Parallelism`)."""
    activation_checkpoint: object
    compile: object

    @classmethod
    def of(cls, config) -> ParallelSettings:
        return cls(
            config.training, config.parallelism, config.activation_checkpoint, config.compile
        )


@dataclass
class ParallelForm:
    """What parallelizing left for running a microbatch through this rank's parts."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """The loss on the model's outputs (the chunked one with `loss_chunk_tokens`)."""
    pipeline: titan_parallel.Pipeline | None = field(default=None, repr=False)
    autocast: torch.dtype | None = None
    """The dtype autocast computes in, or None (FSDP's mixed precision, or float32)."""
    cp_buffers: list[dict[str, int]] = field(default_factory=list)
    """Per part, its sequence-indexed buffers and their sequence dimension (under CP)."""
    cp_style: str = "ring"
    """How context parallel attends: "ring" or "alltoall" (resolved on the whole model)."""
    flops_per_token: float = 0.0


class ModelParallelizer:
    """Builds this rank's parts of the model for one layout: `parallelize`, `materialize`,
    `init_weights`."""

    def __init__(
        self,
        settings: ParallelSettings,
        dims: ParallelDims,
        device: torch.device,
        dtype: torch.dtype,
        *,
        seed: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        self.settings = settings
        self.dims = dims
        self.device = device
        self.dtype = dtype
        self.seed = seed
        self.form = ParallelForm(loss_fn)

    def parallelize(
        self,
        model: nn.Module,
        stage_io: titan_parallel.StageIO | None = None,
        loss_fn: Callable | None = None,
    ) -> list[nn.Module]:
        """Pipeline split (if PP), then TP -> AC -> compile -> FSDP on each part. The parts
        stay on the meta device (see `materialize`). Returns this rank's model parts.
        `stage_io` gives the pipeline static shapes (the dry run's fake process group needs
        them; see `titan_parallel.infer_stage_io`); `loss_fn` is what the pipeline's last
        stage calls (the runner's scaled loss)."""
        training, form = self.settings.training, self.form
        form.flops_per_token = model.flops_per_token(training.seq_len)
        if self.dims.cp_enabled:  # on the whole model: every pipeline stage attends alike
            style = self.settings.parallelism.context_parallel_style
            form.cp_style = titan_parallel.resolve_cp_style(
                style, model, self.dims.tp, self.dims.cp
            )
        if self.dims.pp_enabled:
            form.pipeline = titan_parallel.build_pipeline(
                model,
                self.dims.mesh("pp"),
                local_batch_size=training.local_batch_size,
                seq_len=training.seq_len,
                loss_fn=loss_fn or form.loss_fn,
                device=self.device,
                stage_io=stage_io,
                **self.settings.parallelism.pipeline_options(),
            )
            parts = form.pipeline.model_parts
        else:
            parts = [model]
            if training.loss_chunk_tokens > 0:
                form.loss_fn = _chunked_loss(model, training.loss_chunk_tokens)
        for part in parts:
            self.parallelize_part(part)
        form.autocast = (
            None
            if self._fsdp_mixed_precision
            or self.dtype == torch.float32
            or training.dtype == "bfloat16"  # parameters compute in bf16 as they are
            else self.dtype
        )
        if self.dims.cp_enabled:
            form.cp_buffers = [_cp_buffers(part) for part in parts]
        return parts

    @property
    def _fsdp_mixed_precision(self) -> bool:
        return self.dims.fsdp_enabled or self.dims.dp_replicate_enabled

    def parallelize_part(self, part: nn.Module) -> None:
        """TP -> activation checkpointing -> compile -> FSDP/HSDP/DDP on one model part."""
        s = self.settings
        if s.training.dtype != "float32":  # no float32 master copy ([training] dtype)
            cast_parameters_(part, DTYPES[s.training.dtype])
        titan_parallel.parallelize(
            part,
            self.dims,
            part.tp_plan() if self.dims.tp_enabled else None,
            parallelism=s.parallelism,
            ac=s.activation_checkpoint,
            compile=s.compile,
            param_dtype=self.dtype if self._fsdp_mixed_precision else torch.float32,
            reduce_dtype=DTYPES[s.training.mixed_precision_reduce],
            cpu_offload=s.training.enable_cpu_offload,
            cp_style=self.form.cp_style,
        )

    def materialize(self, parts: list[nn.Module]) -> None:
        """Give the meta-device parts storage (uninitialised) on the training device."""
        offload = self.settings.training.enable_cpu_offload
        for part in parts:
            part.to_empty(device="cpu" if offload else self.device)
            part.train()

    def init_weights(self, parts: list[nn.Module], *, parameters: bool = True) -> None:
        """Initial values: every layout starts from the weights a single process draws with
        this seed (a function of seed and parameter name; see `titan_core.init`). With
        `parameters=False` only buffers are rebuilt: the weights come from a checkpoint."""
        for part in parts:
            if parameters:
                titan_parallel.init_weights_exact(part, self.seed, buffer_device=self.device)
            else:
                part.init_buffers(self.device)


def _cp_buffers(part: nn.Module) -> dict[str, int]:
    """The part's sequence-indexed buffers (`ParallelizableModel.cp_buffers`), checked."""
    if not callable(getattr(part, "cp_buffers", None)):
        raise TypeError(
            f"{type(part).__name__} has no cp_buffers(); context parallel needs it to know which"
            " buffers run along the sequence (see titan_core.protocols.ParallelizableModel)\n"
            "add `def cp_buffers(self): return {}` (or the positional tables with their sequence"
            " dimension), or set [parallelism] context_parallel_degree = 1"
        )
    buffers = dict(part.cp_buffers())
    known = {name for name, _ in part.named_buffers()}
    unknown = sorted(set(buffers) - known)
    if unknown:
        raise ValueError(
            f"{type(part).__name__}.cp_buffers() names {', '.join(unknown)}, which"
            f" {'is not a buffer' if len(unknown) == 1 else 'are not buffers'} of the model"
            f" (its buffers: {', '.join(sorted(known)) or 'none'})"
        )
    return buffers


def _chunked_loss(model: nn.Module, chunk_tokens: int) -> Callable:
    """`[training] loss_chunk_tokens`: the model's output projection hands back the hidden
    states, and the loss applies its weight `chunk_tokens` tokens at a time (the config check
    has refused tensor and pipeline parallel, MTP and a compiled loss)."""
    try:
        output = titan_parallel.defer_output(model)
    except TypeError as e:
        raise ConfigError(
            f"[training] loss_chunk_tokens = {chunk_tokens}: {e}\n"
            'keep "output" in [quantize.linear.float8] filter_fqns, or set'
            " loss_chunk_tokens = 0"
        ) from None
    log.info(
        "loss: the output projection and cross-entropy run %d tokens at a time"
        " ([training] loss_chunk_tokens)",
        chunk_tokens,
    )

    def loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Read at each call: FSDP swaps in the gathered weight for forward and keeps it
        # gathered after the last group's forward (titan_parallel.apply_fsdp).
        return titan_parallel.chunked_cross_entropy(hidden, output.weight, labels, chunk_tokens)

    return loss
