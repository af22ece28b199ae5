"""The job's layout, resolved once: the pre-start checks (`titan_trainer.checks`) build a
`Layout` (the model family and flavor, the `ParallelDims` of the job's world size, the batch
each step takes, and the full model on the meta device, which the checks read) and hand it to
the run, which builds its mesh on those dims and converts and parallelizes that model
(`titan_trainer.model.build_model`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import nn

import titan_parallel
from titan_core import ModelArgs, ModelSpec, ParallelDims
from titan_trainer.batch import BatchShape
from titan_trainer.config import JobConfig
from titan_trainer.model import build_meta_model, model_args_for, model_spec


@dataclass
class Layout:
    """What the pre-start checks resolve once and the run is built from."""

    config: JobConfig
    dims: ParallelDims
    spec: ModelSpec | None = None
    """The model family (found by name when not given; PluginError when none is)."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary once the checks have loaded it (None before)."""
    batch: BatchShape = field(init=False)
    """Samples per microbatch and per step, and the microbatches a step accumulates."""
    _models: dict[int, nn.Module] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = model_spec(self.config)
        self.batch = BatchShape.of(self.config.training, self.dims.dp_degree)

    @classmethod
    def resolve(cls, config: JobConfig, world_size: int, spec: ModelSpec | None = None) -> Layout:
        """The layout `[parallelism]` describes for a job of `world_size` processes (raises
        ConfigError when the degrees do not fit it), training the family `spec` (found by
        name when not given)."""
        return cls(config, config.parallelism.build_parallel_dims(world_size), spec)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def flavor(self) -> ModelArgs:
        """The flavor's own arguments, before the run's settings (`model_args`)."""
        return self.spec.flavors[self.config.model.flavor]

    def model_args(self, vocab_size: int | None = None) -> ModelArgs:
        """The arguments the run's model is built from, for `vocab_size` (see `meta_model`)."""
        return model_args_for(self.spec, self.config, self._vocab(vocab_size))

    def meta_model(self, vocab_size: int | None = None) -> nn.Module:
        """The full model on the meta device for `vocab_size` (default: the tokenizer's, else
        the flavor's own), built on first use; checks only read it."""
        vocab = self._vocab(vocab_size)
        if vocab not in self._models:
            self._models[vocab] = build_meta_model(self.spec, self.config, vocab)
        return self._models[vocab]

    def spare_model(self, vocab_size: int | None = None) -> nn.Module:
        """A copy of `meta_model` that its user may change (no storage: it is on meta)."""
        return copy.deepcopy(self.meta_model(vocab_size))

    def take_model(self, vocab_size: int) -> nn.Module:
        """The model for the run to convert and parallelize in place: the one the checks read,
        which the layout then no longer holds."""
        model = self._models.pop(vocab_size, None)
        return model if model is not None else build_meta_model(self.spec, self.config, vocab_size)

    def cp_style(self) -> str:
        """How context parallel attends ("ring" or "alltoall"): `[parallelism]
        context_parallel_style`, "auto" resolved on the model (`titan_parallel.resolve_cp_style`);
        "ring" without context parallel."""
        if not self.dims.cp_enabled:
            return "ring"
        style = self.config.parallelism.context_parallel_style
        return titan_parallel.resolve_cp_style(style, self.meta_model(), self.dims.tp, self.dims.cp)

    def _vocab(self, vocab_size: int | None) -> int:
        if vocab_size is not None:
            return vocab_size
        if self.vocab_size is not None:
            return self.vocab_size
        return self.flavor.vocab_size


def layout_text(dims: ParallelDims, cp_style: str | None = None) -> str:
    """The layout in one phrase: `dp_shard 8 x tp 8`, `dp_shard 16 (ep 8)` (expert parallel
    borrows its ranks from dp_shard x cp), `cp 4 all-to-all x tp 2` (with the context-parallel
    style when given), or `single process`."""
    styles = {"ring": "ring", "alltoall": "all-to-all"}
    parts = [
        f"{name} {getattr(dims, name)}"
        + (f" {styles[cp_style]}" if name == "cp" and cp_style else "")
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
        if getattr(dims, name) > 1
    ]
    text = " x ".join(parts) or "single process"
    return f"{text} (ep {dims.ep})" if dims.ep > 1 else text
