"""Making one rank's microbatches in the global order (order.py), in the loader's process or in
a worker: `produce` yields, per microbatch, the windows of the positions it was given and the
state of every packing stream it moved."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from titan_core import Tokenizer
from titan_data.errors import DataError
from titan_data.order import Layout, Mixture
from titan_data.packing import SlotStream
from titan_data.sources import Source
from titan_data.token_shards import TokenShards


@dataclass(frozen=True)
class Plan:
    """Everything that fixes a rank's batches (picklable: workers receive it)."""

    sources: Sequence[Source | TokenShards]
    labels: Sequence[str]
    weights: Sequence[float]
    tokenizer: Tokenizer
    seq_len: int
    layout: Layout
    bad_rows: str = "error"
    infinite: bool = True
    seed: int = 0


@dataclass
class Position:
    """The next microbatch: `micro` of step `step`; `counts` are the samples drawn from each
    source before that step (the mixture's whole state)."""

    step: int = 0
    micro: int = 0
    counts: list[int] = field(default_factory=list)


def stream_key(source: int, slot: int) -> str:
    return f"{source}:{slot}"


def slot_of(key: str) -> int:
    return int(key.split(":")[1])


def produce(
    plan: Plan,
    start: Position,
    stream_states: dict[str, dict[str, Any]],
    positions: Sequence[int],
) -> Iterator[dict[str, Any]]:
    """Per microbatch from `start` on: {"step", "micro", "windows": int64 [len(positions),
    seq_len + 1], "streams": {key: state} of the packing streams it moved}. Stops (after the
    last whole microbatch) when a finite loader runs out."""
    layout, seq_len = plan.layout, plan.seq_len
    mixture = Mixture(list(plan.weights))
    streams: dict[str, SlotStream] = {}

    def stream(source: int, slot: int) -> SlotStream:
        key = stream_key(source, slot)
        if key not in streams:
            made = SlotStream(
                plan.sources[source],
                plan.tokenizer,
                slot=slot,
                slots=layout.global_batch,
                seq_len=seq_len,
                bad_rows=plan.bad_rows,
                infinite=plan.infinite,
                log_epochs=slot == layout.first_slot,
            )
            if key in stream_states:
                made.load_state_dict(stream_states[key])
            streams[key] = made
        return streams[key]

    step, micro, counts = start.step, start.micro, list(start.counts)
    while True:
        draws = mixture.assign(counts, layout.global_batch)  # counts move to the next step
        for m in range(micro, layout.accumulation):
            windows, moved = [], set()
            for position in positions:
                slot = layout.slot(m, position)
                source, index = draws[slot]
                src = plan.sources[source]
                if isinstance(src, TokenShards):
                    window, epoch = src.window(index, seq_len, plan.seed)
                    if epoch and not plan.infinite:
                        return
                else:
                    key = stream_key(source, slot)
                    window = stream(source, slot).next_window()
                    if window is None:
                        return
                    moved.add(key)
                windows.append(window)
            yield {
                "step": step,
                "micro": m,
                "windows": np.stack(windows),
                "streams": {key: streams[key].state_dict() for key in sorted(moved)},
            }
        step, micro = step + 1, 0


def check_streams(plan: Plan) -> None:
    """Raise DataError unless every source fits the run: a folder of tokens is complete, made
    by this tokenizer and holds one sample; every packing stream of raw text this rank reads
    fills one sample in one pass (read from the beginning, in probes of their own, as far as
    one sample). A source that is empty, holds only empty documents, or has too few documents
    for the global batch would otherwise make an infinite loader cycle without a batch."""
    for src in plan.sources:
        if isinstance(src, TokenShards):
            src.check()
            src.check_tokenizer(plan.tokenizer)
            if src.windows(plan.seq_len) < 1:
                raise DataError(
                    f"dataset {src.name} ({src.description}) holds {src.tokens:,} tokens, fewer"
                    f" than one sample needs: seq_len {plan.seq_len} + 1\nuse more data or a"
                    " smaller seq_len"
                )
            continue
        for slot in plan.layout.slots():
            probe = SlotStream(
                src,
                plan.tokenizer,
                slot=slot,
                slots=plan.layout.global_batch,
                seq_len=plan.seq_len,
                bad_rows=plan.bad_rows,
                infinite=False,
            )
            if probe.next_window() is None:
                raise DataError(probe.too_small_message())
