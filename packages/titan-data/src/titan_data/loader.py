"""The loader a trainer iterates: one data-parallel rank's `(inputs, labels)` microbatches in the
global sample order (order.py), made in this process or in worker processes (workers.py), with
a state that is a position in that order, so that any layout can resume from it."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch

from titan_core import LoaderBase, StateMismatchError, Tokenizer, get_logger
from titan_data.batches import Plan, Position, check_streams, produce, slot_of
from titan_data.errors import BAD_ROWS, SKIP_HINT, DataError
from titan_data.mixture import parse_datasets
from titan_data.order import Layout, Mixture
from titan_data.sources import Source, check_source, load_source, scan_bad_rows
from titan_data.token_shards import TokenShards
from titan_data.workers import start_workers, worker_count

log = get_logger("data")

STATE_VERSION = 2


class TitanDataLoader(LoaderBase):
    """Yields `(inputs, labels)` int64 tensors of shape [batch_size, seq_len]: windows of
    `seq_len + 1` tokens, `inputs = window[:-1]`, `labels = window[1:]`.

    The loader is one stream: every `iter()` continues where the previous one stopped.
    `state_dict()` is this rank's part of the position after the last batch yielded (the step,
    the microbatch, the samples drawn from each source, and the packing streams this rank
    reads); `merge_state_dicts` joins every data-parallel rank's part into the job's global
    position, and `load_state_dict` takes either, on any data-parallel layout with the same
    global batch: the run continues with exactly the global batches the uninterrupted one saw.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ):
        self.plan = plan
        self.layout = plan.layout
        self.num_workers = worker_count(num_workers, plan.layout.batch_size)
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.position = Position(counts=[0] * len(plan.sources))
        self.streams: dict[str, dict[str, Any]] = {}  # state of each stream this rank moved
        self._mixture = Mixture(list(plan.weights))
        self._groups: Iterator[list[dict[str, Any]]] | None = None
        self._exhausted = False

    # ------------------------------------------------------------------ iteration

    def _start(self) -> Iterator[list[dict[str, Any]]]:
        start = copy.deepcopy(self.position)
        streams = copy.deepcopy(self.streams)
        if self.num_workers == 0:
            items = produce(self.plan, start, streams, range(self.layout.batch_size))
            return ([item] for item in items)
        return start_workers(self.plan, start, streams, self.num_workers, self.prefetch_factor)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while not self._exhausted:
            if self._groups is None:
                self._groups = self._start()
            group = next(self._groups, None)
            if group is None:
                self._exhausted = True  # a finite loader's last partial step is dropped
                return
            batch = self._assemble(group)
            for item in group:
                self.streams.update(item["streams"])
            self._advance()
            yield batch[:, :-1], batch[:, 1:]

    def _assemble(self, group: list[dict[str, Any]]) -> torch.Tensor:
        if len(group) == 1:
            rows = group[0]["windows"]
        else:  # worker w made positions w, w + W, ...: put its rows back there
            rows = np.empty((self.layout.batch_size, self.plan.seq_len + 1), dtype=np.int64)
            for w, item in enumerate(group):
                rows[w :: len(group)] = item["windows"]
        batch = torch.from_numpy(rows)
        return batch.pin_memory() if self.pin_memory else batch

    def _advance(self) -> None:
        p = self.position
        p.micro += 1
        if p.micro < self.layout.accumulation:
            return
        before = list(p.counts)
        self._mixture.assign(p.counts, self.layout.global_batch)
        p.step, p.micro = p.step + 1, 0
        self._log_token_epochs(before, p.counts)

    def _log_token_epochs(self, before: list[int], after: list[int]) -> None:
        for j, src in enumerate(self.plan.sources):
            if isinstance(src, TokenShards):
                count = src.windows(self.plan.seq_len)
                if after[j] // count > before[j] // count:
                    log.info(
                        "data: %s epoch %d ended after %s samples; starting epoch %d",
                        src.name,
                        before[j] // count,
                        f"{count:,}",
                        after[j] // count,
                    )

    def close(self) -> None:
        """Stop the worker processes (if any); the next `iter()` starts them again from here."""
        if self._groups is not None:
            self._groups.close()
            self._groups = None

    @property
    def skipped_rows(self) -> int:
        """Rows this rank's streams skipped as not being documents (`bad_rows="skip"`), over
        the loader's life (carried through `state_dict`)."""
        return sum(int(state["skipped"]) for state in self.streams.values())

    @property
    def tokens_by_source(self) -> dict[str, int]:
        """Input tokens taken from each source by the whole job (every rank) up to the last
        complete step, by label (see `titan_data.mixture`)."""
        return {
            label: count * self.plan.seq_len
            for label, count in zip(self.plan.labels, self.position.counts)
        }

    # ------------------------------------------------------------------ checkpointing

    def _order(self) -> dict[str, Any]:
        """What fixes the global sample order; a state only fits a loader with the same."""
        order = {
            "global_batch_size": self.layout.global_batch,
            "seq_len": self.plan.seq_len,
            "datasets": [getattr(s, "name", str(s)) for s in self.plan.sources],
            "weights": list(self._mixture.weights),
            "vocab_size": self.plan.tokenizer.vocab_size,
        }
        if any(isinstance(s, TokenShards) for s in self.plan.sources):
            order["seed"] = self.plan.seed  # the order of a folder of tokens' windows
        return order

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the global position (plain Python values)."""
        return {
            "version": STATE_VERSION,
            "order": self._order(),
            "step": self.position.step,
            "micro": self.position.micro,
            "counts": list(self.position.counts),
            "layout": {
                "batch_size": self.layout.batch_size,
                "dp_world_size": self.layout.dp_world_size,
            },
            "exhausted": self._exhausted,
            "streams": {key: _plain(state) for key, state in sorted(self.streams.items())},
        }

    def merge_state_dicts(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The job's global position from every data-parallel rank's `state_dict()`."""
        merged = copy.deepcopy(parts[0])
        shared = ("version", "order", "step", "micro", "counts", "layout", "exhausted")
        for rank, part in enumerate(parts[1:], 1):
            differ = [k for k in shared if part.get(k) != merged.get(k)]
            if differ:
                raise ValueError(
                    f"data loader states disagree between data-parallel ranks 0 and {rank} on"
                    f" {', '.join(differ)}: the ranks did not take the same number of batches"
                )
            merged["streams"].update(copy.deepcopy(part["streams"]))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a state of this loader, merged or not, saved on any data-parallel layout
        with the same global sample order (global batch size, seq_len, datasets and weights,
        tokenizer; the seed for folders of tokens). A state saved in the middle of a step needs
        the layout it was saved with."""
        self._check_fits(state_dict)
        mine = set(self.layout.slots())
        self.position = Position(
            int(state_dict["step"]), int(state_dict["micro"]), list(state_dict["counts"])
        )
        self.streams = {
            key: copy.deepcopy(state)
            for key, state in state_dict["streams"].items()
            if slot_of(key) in mine
        }
        self._exhausted = bool(state_dict["exhausted"])
        self.close()  # workers (if any) start again from here at the next batch

    def _check_fits(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise StateMismatchError(
                f"data loader state version {state.get('version')!r} (this loader:"
                f" {STATE_VERSION}): it was saved by an older titan-data, whose position was"
                " per data-parallel rank and cannot be placed in the global order; set"
                ' [checkpoint] exclude_from_loading = ["dataloader"] to start the data afresh'
            )
        saved, now = state["order"], self._order()
        wrong = [
            f"{key} {saved.get(key)!r} (this loader: {value!r})"
            for key, value in now.items()
            if saved.get(key) != value
        ]
        if wrong:
            raise StateMismatchError(
                "data loader state does not fit this loader: it was saved with "
                + ", ".join(wrong)
                + "; these fix the order of the samples, so resume with the values it was saved"
                " with (keep the global batch size when the data-parallel degree changes), or"
                " start the data afresh"
            )
        layout = {"batch_size": self.layout.batch_size, "dp_world_size": self.layout.dp_world_size}
        if state["micro"] and state["layout"] != layout:
            raise StateMismatchError(
                f"data loader state was saved after microbatch {state['micro']} of a step with"
                f" {state['layout']}; this loader has {layout}: only a state saved between steps"
                " resumes on another layout"
            )

    def __repr__(self) -> str:
        names = ", ".join(
            f"{label}:{w:.3g}" for label, w in zip(self.plan.labels, self._mixture.weights)
        )
        return (
            f"TitanDataLoader({names}, seq_len={self.plan.seq_len},"
            f" batch_size={self.layout.batch_size}, global_batch_size={self.layout.global_batch},"
            f" dp {self.layout.dp_rank}/{self.layout.dp_world_size},"
            f" workers={self.num_workers}, infinite={self.plan.infinite},"
            f" bad_rows={self.plan.bad_rows})"
        )


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """A stream state with its token buffer as a list of ints (checkpoints keep plain values)."""
    out = dict(state)
    out["buffer"] = np.asarray(state["buffer"], dtype=np.int64).tolist()
    return out


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    seq_len: int,
    batch_size: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    infinite: bool = True,
    text_field: str = "text",
    bad_rows: Literal["error", "skip"] = "error",
    global_batch_size: int | None = None,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
    seed: int = 0,
) -> TitanDataLoader:
    """A checkpointable loader of packed `(inputs, labels)` batches for one data-parallel rank.

    `dataset` (+ `dataset_path`) names one dataset in the forms `titan_data.sources` lists, or a
    weighted mixture (`titan_data.mixture`); `text_field` is the column holding the text in
    jsonl/parquet/hub data. `global_batch_size` (samples per optimizer step over all ranks;
    default `batch_size x dp_world_size`) fixes the global sample order together with the
    datasets, `seq_len`, the tokenizer and `seed`; a rank yields `global_batch_size /
    (batch_size x dp_world_size)` microbatches per step. `num_workers` processes make the
    batches (0: this process), each keeping `prefetch_factor` ready. With `infinite` (the
    default) the data repeats, epoch after epoch; otherwise iteration stops at the end of the
    data (the last partial step is dropped).

    Checked here, before any batch: every source exists and is not empty, its first row has the
    text field, every packing stream this rank reads fills one sample, folders of tokens are
    complete and made by `tokenizer`, and (with `bad_rows="error"`) every row of local
    jsonl/json/text files is a text document; a bad one raises DataError naming file and line.
    With `bad_rows="skip"` bad rows are skipped and counted (`skipped_rows`).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must be >= 1")
    if bad_rows not in BAD_ROWS:
        raise ValueError(f"bad_rows = {bad_rows!r}; use one of {', '.join(BAD_ROWS)}")
    if global_batch_size is None or global_batch_size == -1:
        global_batch_size = batch_size * dp_world_size
    layout = Layout(global_batch_size, batch_size, dp_rank, dp_world_size)
    entries = parse_datasets(dataset, dataset_path)
    sources = []
    for entry in entries:
        source = load_source(entry.dataset, entry.dataset_path, text_field)
        check_source(source)
        if bad_rows == "error" and isinstance(source, Source):
            check_rows(source)
        sources.append(source)
    plan = Plan(
        sources=sources,
        labels=[e.label for e in entries],
        weights=[e.weight for e in entries],
        tokenizer=tokenizer,
        seq_len=seq_len,
        layout=layout,
        bad_rows=bad_rows,
        infinite=infinite,
        seed=seed,
    )
    check_streams(plan)
    return TitanDataLoader(
        plan, num_workers=num_workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory
    )


def check_rows(source: Source) -> None:
    """Every row of `source`'s local files is a text document, or DataError names the first
    that is not (file and line)."""
    if not source.files:
        return
    start = time.perf_counter()
    rows, bad = scan_bad_rows(source)
    if bad:
        raise DataError(f"dataset {source.name}: {bad}\n{SKIP_HINT}")
    seconds = time.perf_counter() - start
    if seconds > 1:
        log.info("data: checked %s rows of %s in %.1fs", f"{rows:,}", source.description, seconds)
