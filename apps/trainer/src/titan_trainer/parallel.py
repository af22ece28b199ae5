"""How the trainer uses titan-parallel: split into pipeline stages, parallelize and initialise,
run one microbatch forward and backward (with loss parallel, context parallel, a pipeline
schedule or autocast as the layout needs), clip gradients over every mesh dimension, reduce
the loss; and evaluate a batch forward only (the pipeline's forward-only schedule under PP)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

import titan_parallel
from titan_core import ConfigError, ParallelDims, get_logger
from titan_trainer.loss import with_mtp
from titan_trainer.precision import DTYPES, cast_parameters_

log = get_logger("parallel")

IGNORE_INDEX = -100
"""The label that counts for no loss (F.cross_entropy's `ignore_index`): padding, masked
prompt tokens. Validation weighs each rank by the tokens it counts."""


@dataclass
class ParallelRuntime:
    config: object
    dims: ParallelDims
    device: torch.device
    dtype: torch.dtype
    seed: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    flops_per_token: float = 0.0
    pipeline: titan_parallel.Pipeline | None = field(default=None, repr=False)
    autocast: torch.dtype | None = None
    document_start_id: int | None = None
    """With `[model] attn_mask_type = "block_causal"`: the token id that starts each document
    (BOS); every forward then gets the `document_ids` it gives (see `model_kwargs`)."""
    _scale: float = 1.0
    _summing: bool = False
    _cp_buffers: list[dict[str, int]] = field(default_factory=list)

    # ------------------------------------------------------------------ build
    def parallelize(
        self, model: nn.Module, stage_io: titan_parallel.StageIO | None = None
    ) -> list[nn.Module]:
        """Pipeline split (if PP), then TP -> AC -> compile -> FSDP on each part. The parts
        stay on the meta device (see `materialize`). Returns this rank's model parts.
        `stage_io` gives the pipeline static shapes (the dry run's fake process group needs
        them; see `titan_parallel.infer_stage_io`)."""
        self.flops_per_token = model.flops_per_token(self.config.training.seq_len)
        if self.dims.pp_enabled:
            self.pipeline = titan_parallel.build_pipeline(
                model,
                self.dims.mesh("pp"),
                local_batch_size=self.config.training.local_batch_size,
                seq_len=self.config.training.seq_len,
                loss_fn=self._scaled_loss,
                device=self.device,
                stage_io=stage_io,
                **self.config.parallelism.pipeline_options(),
            )
            parts = self.pipeline.model_parts
        else:
            parts = [model]
            if self.config.training.loss_chunk_tokens > 0:
                self.loss_fn = _chunked_loss(model, self.config.training.loss_chunk_tokens)
        for part in parts:
            self.parallelize_part(part)
        self.autocast = (
            None
            if self._fsdp_mixed_precision
            or self.dtype == torch.float32
            or self.config.training.dtype == "bfloat16"  # parameters compute in bf16 as they are
            else self.dtype
        )
        if self.dims.cp_enabled:
            self._cp_buffers = [_cp_buffers(part) for part in parts]
        return parts

    @property
    def _fsdp_mixed_precision(self) -> bool:
        return self.dims.fsdp_enabled or self.dims.dp_replicate_enabled

    def parallelize_part(self, part: nn.Module) -> None:
        """TP -> activation checkpointing -> compile -> FSDP/HSDP/DDP on one model part."""
        cfg = self.config
        if cfg.training.dtype != "float32":  # no float32 master copy ([training] dtype)
            cast_parameters_(part, DTYPES[cfg.training.dtype])
        titan_parallel.parallelize(
            part,
            self.dims,
            part.tp_plan() if self.dims.tp_enabled else None,
            parallelism=cfg.parallelism,
            ac=cfg.activation_checkpoint,
            compile=cfg.compile,
            param_dtype=self.dtype if self._fsdp_mixed_precision else torch.float32,
            reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce],
            cpu_offload=cfg.training.enable_cpu_offload,
        )

    def materialize(self, parts: list[nn.Module]) -> None:
        """Give the meta-device parts storage (uninitialised) on the training device."""
        for part in parts:
            part.to_empty(device="cpu" if self.config.training.enable_cpu_offload else self.device)
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

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._summing:  # evaluation: the sum over the tokens the mean is taken over
            return _token_sum(self.loss_fn(output, target), target)
        return self.loss_fn(output, target) * self._scale

    # ------------------------------------------------------------------ steps
    def forward_backward(
        self,
        parts: list[nn.Module],
        inputs: torch.Tensor,
        labels: torch.Tensor,
        scale: float,
        *,
        mark: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Loss of one microbatch times `scale` (detached); gradients accumulate. `mark`, when
        given, is called with "forward" once the loss is computed and "backward" once the
        gradients are (not under pipeline parallel, whose schedule interleaves the two)."""
        self._scale = scale
        inputs, labels = self._own_batch(inputs, labels)
        kwargs = self.model_kwargs(inputs)
        with self._contexts(parts, inputs, labels):
            if self.pipeline is not None:
                loss = self.pipeline.step(inputs, labels, **kwargs)
                return titan_parallel.broadcast_pipeline_loss(
                    loss, self.dims.mesh("pp"), self.device
                )
            (model,) = parts
            loss = self._scaled_loss(model(inputs, **kwargs), labels)
            if mark is not None:
                mark("forward")
            loss.backward()
        if mark is not None:
            mark("backward")
        return _plain(loss.detach())

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model's forward gets besides the tokens: `document_ids` (`[batch, seq]`,
        the documents started so far at each position) for block-causal attention."""
        if self.document_start_id is None:
            return {}
        return {"document_ids": (inputs == self.document_start_id).cumsum(dim=-1)}

    def eval_loss(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss summed over the batch's counted tokens, how many there are; both float32
        on the device) for this rank's part of the batch: its context-parallel piece, and under
        pipeline parallel the last stage's sum on every pipeline rank. A loss function that
        averages over the tokens whose label is not IGNORE_INDEX (cross-entropy) gives exact
        sums; sum both over the data-parallel ranks for the mean over every token."""
        inputs, labels = self._own_batch(inputs, labels)
        kwargs = self.model_kwargs(inputs)
        with torch.no_grad(), self._contexts(parts, inputs, labels):
            tokens = (labels != IGNORE_INDEX).sum().float()  # this rank's piece under CP
            if self.pipeline is None:
                (model,) = parts
                total = _token_sum(self.loss_fn(model(inputs, **kwargs), labels), labels)
            else:
                total = self._pipeline_eval(inputs, labels, kwargs)
        return total.float(), tokens

    def _pipeline_eval(self, inputs, labels, kwargs) -> torch.Tensor:
        """The forward-only schedule over pieces of the training local batch's size (the
        stages exchange tensors of the training microbatch's shape), summed; on every rank."""
        size = self.config.training.local_batch_size
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._summing = True
        try:
            for start in range(0, inputs.shape[0], size):
                piece = {k: v[start : start + size] for k, v in kwargs.items()}
                part = self.pipeline.eval(
                    inputs[start : start + size], labels[start : start + size], **piece
                )
                if part is not None:
                    total += part
        finally:
            self._summing = False
        return titan_parallel.broadcast_pipeline_loss(total, self.dims.mesh("pp"), self.device)

    def _own_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # CP shards the batch in place; the loader's inputs and labels are two views of one
        # packed window, so each needs memory of its own first.
        if not self.dims.cp_enabled:
            return inputs, labels
        return tuple(t.clone(memory_format=torch.contiguous_format) for t in (inputs, labels))

    def _contexts(self, parts, inputs, labels) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.dims.cp_enabled:
            # Shard the batch and each part's positional buffers along the sequence for this step.
            buffers = [
                (part.get_buffer(name), dim)
                for part, names in zip(parts, self._cp_buffers)
                for name, dim in names.items()
            ]
            stack.enter_context(
                titan_parallel.cp_context(
                    self.dims.mesh("cp"),
                    [inputs, labels, *(b for b, _ in buffers)],
                    [1, 1, *(d for _, d in buffers)],
                    {inputs, labels},
                    rotate_method=self.config.parallelism.context_parallel_rotate_method,
                )
            )
        stack.enter_context(titan_parallel.loss_context(self.dims, self.config.parallelism))
        if self.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
        return stack

    def clip_grad_norm(self, parts: list[nn.Module], max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping, left on the device (no read-back)."""
        params = [p for part in parts for p in part.parameters()]
        return titan_parallel.clip_grad_norm_(
            params, max_norm if max_norm > 0 else float("inf"), pp_mesh=self.dims.mesh("pp")
        )

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over the data-parallel and context-parallel ranks, on the device."""
        mesh = self.dims.mesh("dp_cp")
        values = values.detach().float()
        if mesh is None:
            return values
        if mesh.device_type != "cpu" and values.device.type == "cpu":
            values = values.to(mesh.device_type)
        return funcol.all_reduce(values, reduceOp="sum", group=mesh)

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


def _token_sum(mean: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A mean loss over the counted tokens of `labels`, times their number (0 for none)."""
    count = (labels != IGNORE_INDEX).sum()
    mean = _plain(mean).float()
    return torch.where(count > 0, mean * count, torch.zeros_like(mean))


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel returns a replicated DTensor; the step's sum wants a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def build_parallel_runtime(config, dims, device, dtype, seed, loss_fn) -> ParallelRuntime:
    """The runtime for this layout; the loss is compiled when [compile] lists "loss", and
    takes a multi-token-prediction model's logits of every depth (`titan_trainer.loss`)."""
    compiled = titan_parallel.compile_loss(loss_fn, config.compile)
    return ParallelRuntime(
        config, dims, device, dtype, seed, with_mtp(compiled, config.training.mtp_loss_weight)
    )
