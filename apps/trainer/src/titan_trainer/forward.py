"""How a microbatch runs through this rank's parallelized parts (`titan_trainer.parallel`'s
`ParallelForm`): forward and backward for training (context-parallel sharding, loss parallel,
autocast, the pipeline schedule under PP), and forward only for validation, whose sums are
exact over the counted tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor

import titan_parallel
from titan_trainer.parallel import ModelParallelizer, ParallelForm

IGNORE_INDEX = -100
"""The label that counts for no loss (F.cross_entropy's `ignore_index`): padding, masked
prompt tokens. Validation weighs each rank by the tokens it counts."""


class MicrobatchRunner:
    """Runs microbatches through the parts `parallelizer` built (its dims, device, settings
    and `ParallelForm`, read when used: the parts are built after this runner)."""

    def __init__(self, parallelizer: ModelParallelizer) -> None:
        self.parallelizer = parallelizer
        self.document_start_id: int | None = None
        """With `[model] attn_mask_type = "block_causal"`: the token id that starts each
        document (BOS); every forward then gets the `document_ids` it gives (see
        `model_kwargs`)."""
        self._scale = 1.0
        self._summing = False
        self._rows: list[torch.Tensor] | None = None

    @property
    def form(self) -> ParallelForm:
        return self.parallelizer.form

    @property
    def dims(self):
        return self.parallelizer.dims

    @property
    def device(self) -> torch.device:
        return self.parallelizer.device

    @property
    def settings(self):
        return self.parallelizer.settings

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss the pipeline's last stage and a plain forward take: times the step's scale
        (1 / microbatches) in training, the sum over the counted tokens in evaluation."""
        if self._rows is not None:  # eval_rows: each row's sums, kept; the schedule gets the total
            rows = row_scores(self.form.loss_fn, output, target)
            self._rows.append(rows)
            return rows[:, 0].sum()
        if self._summing:
            return _token_sum(self.form.loss_fn(output, target), target)
        return self.form.loss_fn(output, target) * self._scale

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
            if self.form.pipeline is not None:
                loss = self.form.pipeline.step(inputs, labels, **kwargs)
                return titan_parallel.broadcast_pipeline_loss(
                    loss, self.dims.mesh("pp"), self.device
                )
            (model,) = parts
            loss = self.scaled_loss(model(inputs, **kwargs), labels)
            if mark is not None:
                mark("forward")
            loss.backward()
        if mark is not None:
            mark("backward")
        return _plain(loss.detach())

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model's forward gets besides the tokens: `document_ids` (`[batch, seq]`,
        the documents started so far at each position) for block-causal attention. Under ring
        context parallel the ring takes them (see `_contexts`) and builds each pair of chunks'
        mask itself; the model gets them only under pipeline parallel, whose schedule cuts them
        into its microbatches with the tokens, for the ring to read each microbatch's rows off
        the model's mask (`titan_core.DocumentMask`)."""
        if self.document_start_id is None:
            return {}
        if self._documents_go_round_the_ring and self.form.pipeline is None:
            return {}
        return {"document_ids": self._document_ids(inputs)}

    def _document_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        return (inputs == self.document_start_id).cumsum(dim=-1)

    @property
    def _documents_go_round_the_ring(self) -> bool:
        return (
            self.document_start_id is not None
            and self.dims.cp_enabled
            and self.form.cp_style == "ring"
        )

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
            if self.form.pipeline is None:
                (model,) = parts
                total = _token_sum(self.form.loss_fn(model(inputs, **kwargs), labels), labels)
            else:
                total = self._pipeline_eval(inputs, labels, kwargs)
        return total.float(), tokens

    def eval_rows(
        self, parts: list[nn.Module], inputs: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """Per row of the batch (`[rows, 2]`, float32 on the device): the loss summed over the
        row's counted tokens, and how many of them the model's top choice misses; for this
        rank's context-parallel piece (sum both over the context-parallel ranks), on every
        pipeline rank. One forward for the batch (under PP, the forward-only schedule in pieces
        of the training local batch's size)."""
        inputs, labels = self._own_batch(inputs, labels)
        kwargs = self.model_kwargs(inputs)
        with torch.no_grad(), self._contexts(parts, inputs, labels):
            if self.form.pipeline is None:
                (model,) = parts
                return row_scores(self.form.loss_fn, model(inputs, **kwargs), labels).float()
            self._rows = []
            try:
                self._pipeline_eval(inputs, labels, kwargs)
                mine = self._rows
            finally:
                self._rows = None
        # Only the last stage computed the rows: a sum where one rank contributes.
        rows = (
            torch.cat(mine).float()
            if mine
            else torch.zeros(inputs.shape[0], 2, dtype=torch.float32, device=self.device)
        )
        return funcol.all_reduce(rows, reduceOp="sum", group=self.dims.mesh("pp"))

    def _pipeline_eval(self, inputs, labels, kwargs) -> torch.Tensor:
        """The forward-only schedule over pieces of the training local batch's size (the
        stages exchange tensors of the training microbatch's shape), summed; on every rank."""
        size = self.settings.training.local_batch_size
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._summing = True
        try:
            for start in range(0, inputs.shape[0], size):
                piece = {k: v[start : start + size] for k, v in kwargs.items()}
                part = self.form.pipeline.eval(
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
                for part, names in zip(parts, self.form.cp_buffers)
                for name, dim in names.items()
            ]
            stack.enter_context(
                titan_parallel.cp_context(
                    self.dims.mesh("cp"),
                    [inputs, labels, *(b for b, _ in buffers)],
                    [1, 1, *(d for _, d in buffers)],
                    {inputs, labels},
                    rotate_method=self.settings.parallelism.context_parallel_rotate_method,
                    style=self.form.cp_style,
                    # The whole batch's documents (`inputs` is cut as the context opens).
                    document_ids=(
                        self._document_ids(inputs) if self._documents_go_round_the_ring else None
                    ),
                )
            )
        stack.enter_context(titan_parallel.loss_context(self.dims, self.settings.parallelism))
        if self.form.autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.form.autocast))
        return stack


def row_scores(loss_fn, output, labels: torch.Tensor) -> torch.Tensor:
    """`[rows, 2]`: each row's loss summed over its counted tokens (`loss_fn` on the row alone,
    the training loss as it is: loss parallel's vocabulary-sharded logits included), and how
    many counted tokens' top logit is not the label. A multi-token-prediction model's tuple
    of logits is scored by its next-token logits."""
    if isinstance(output, tuple):
        output = output[0]
    sums, misses = [], []
    for row in range(labels.shape[0]):
        target = labels[row : row + 1]
        logits = output[row : row + 1]
        sums.append(_token_sum(loss_fn(logits, target), target))
        counted = target != IGNORE_INDEX
        if isinstance(logits, DTensor):  # vocabulary-sharded: the row's logits whole
            logits = logits.full_tensor()
        top = logits.argmax(dim=-1)
        misses.append(((top != target) & counted).sum().float())
    return torch.stack([torch.stack(sums), torch.stack(misses)], dim=1)


def _token_sum(mean: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A mean loss over the counted tokens of `labels`, times their number (0 for none)."""
    count = (labels != IGNORE_INDEX).sum()
    mean = _plain(mean).float()
    return torch.where(count > 0, mean * count, torch.zeros_like(mean))


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """Loss parallel returns a replicated DTensor; the step's sum wants a plain tensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
