"""The global sample order: which sample of which source each slot of each global batch holds,
and which slots a data-parallel rank takes. Nothing here depends on the data-parallel degree,
so a run resumed on another layout continues with the same global batches.

A job's stream of samples (windows of `seq_len + 1` tokens) is cut into global batches of
`global_batch` samples, one per optimizer step. Slot `s` of step `t` holds global sample
`t * global_batch + s`:

- its source is chosen by `Mixture` from the source weights: sample n goes to the source that
  is furthest behind its share (the largest `weight * (n + 1) - count`), so the counts stay
  within one sample of their shares at every step, deterministically;
- for a source of raw text, the sample is the next window of packing stream `s` of that
  source, which packs the documents whose index is `s mod global_batch` (see readers.py);
  for a folder of tokens, it is window `count` of the source (see token_shards.py).

`Layout` gives data-parallel rank `r` of `D` the slots `[r * G/D, (r + 1) * G/D)` of every step,
in `G / (batch_size * D)` microbatches of `batch_size` slots: concatenating every rank's
microbatches in rank order gives the global batch, on any layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Where one data-parallel rank's microbatches sit in each global batch."""

    global_batch: int
    """Samples per optimizer step over every rank (the global batch size)."""
    batch_size: int
    """Samples per microbatch on this rank (the local batch size)."""
    dp_rank: int = 0
    dp_world_size: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.global_batch < 1:
            raise ValueError(
                f"batch_size ({self.batch_size}) and global_batch_size ({self.global_batch})"
                " must be >= 1"
            )
        if not 0 <= self.dp_rank < self.dp_world_size:
            raise ValueError(
                f"dp_rank {self.dp_rank} is not in [0, dp_world_size={self.dp_world_size})"
            )
        per_step = self.batch_size * self.dp_world_size
        if self.global_batch % per_step:
            raise ValueError(
                f"global_batch_size {self.global_batch} is not a multiple of batch_size x"
                f" dp_world_size = {self.batch_size} x {self.dp_world_size} = {per_step}"
            )

    @property
    def accumulation(self) -> int:
        """Microbatches per step on each rank."""
        return self.global_batch // (self.batch_size * self.dp_world_size)

    @property
    def first_slot(self) -> int:
        return self.dp_rank * (self.global_batch // self.dp_world_size)

    def slot(self, micro: int, position: int) -> int:
        """The global slot of `position` in microbatch `micro` on this rank."""
        return self.first_slot + micro * self.batch_size + position

    def slots(self) -> range:
        """Every slot this rank holds, in the order it yields them."""
        return range(self.first_slot, self.first_slot + self.global_batch // self.dp_world_size)


class Mixture:
    """Which source each sample comes from, given the source weights (see the module
    docstring). `counts` (samples drawn from each source so far) is the whole state."""

    def __init__(self, weights: list[float]):
        total = float(sum(weights))
        self.weights = [w / total for w in weights]

    def assign(self, counts: list[int], samples: int) -> list[tuple[int, int]]:
        """(source, index within that source) of the next `samples` samples; `counts` moves on."""
        if len(self.weights) == 1:
            start = counts[0]
            counts[0] += samples
            return [(0, start + i) for i in range(samples)]
        out = []
        n = sum(counts)
        for _ in range(samples):
            n += 1
            best = max(range(len(counts)), key=lambda j: (self.weights[j] * n - counts[j], -j))
            out.append((best, counts[best]))
            counts[best] += 1
        return out
