"""How many samples a step takes, derived once from `[training]` and the data-parallel degree
and passed on: the loader's global order, the gradient accumulation, the tokens counted, the
checks and the resume check all read the one `BatchShape`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    """A step's batch over the job's data-parallel ranks (one replica group's, under fault
    tolerance: each group is a job of its own)."""

    local: int
    """Samples per data-parallel rank per microbatch (`local_batch_size`)."""
    seq_len: int
    """Tokens per sample."""
    dp_degree: int
    """Data-parallel ranks."""
    global_size: int
    """Samples per optimizer step: `global_batch_size`, or local x data-parallel for -1."""

    @classmethod
    def of(cls, training, dp_degree: int) -> BatchShape:
        """The batch of a `[training]` section on `dp_degree` data-parallel ranks."""
        local = training.local_batch_size
        wanted = training.global_batch_size
        return cls(
            local, training.seq_len, dp_degree, local * dp_degree if wanted == -1 else wanted
        )

    @property
    def per_microbatch(self) -> int:
        """Samples every data-parallel rank's microbatch takes together."""
        return self.local * self.dp_degree

    @property
    def accumulation(self) -> int:
        """Microbatches per optimizer step (gradient accumulation)."""
        return self.global_size // self.per_microbatch

    @property
    def divides(self) -> bool:
        """Whether a whole number of microbatches makes the global batch."""
        return self.global_size % self.per_microbatch == 0

    @property
    def rank_tokens(self) -> int:
        """Tokens one data-parallel rank trains on per step."""
        return self.local * self.seq_len * self.accumulation
