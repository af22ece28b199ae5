"""Downstream evaluation during training (`[eval]`): tasks read from local files
(`titan_data.eval_tasks`), scored on the training layout itself, with the forward the run
already has (FSDP, TP, PP, CP, EP; no second copy of the model).

Each task's requests (a context and one continuation) are sorted longest first and cut into
forwards of `[eval] local_batch_size` rows, each row one request padded to the longest of its
forward (to `training.seq_len` under pipeline or context parallel, or compile, whose shapes are fixed); the
forwards are dealt round the data-parallel ranks, and every rank runs as many (a rank short of
one runs a row of padding). A request's log-likelihood is minus its row's summed loss over the
continuation's tokens, taken with the training loss itself; the scores follow from those as
lm-evaluation-harness computes them. The log gives each task's forwards and seconds."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import torch

from titan_core import ConfigError, get_logger
from titan_data.eval_tasks import (
    Task,
    TaskError,
    build_task,
    load_task_spec,
    samples,
    score,
)
from titan_trainer.forward import IGNORE_INDEX

log = get_logger("eval")

RESULTS_FILE = "eval_results.jsonl"
"""In the dump folder: one JSON line per task and evaluation (rank 0 writes it)."""


@dataclass
class TaskResult:
    name: str
    scores: dict[str, float]
    items: int
    requests: int
    forwards: int
    """Forwards each rank ran for the task."""
    seconds: float
    samples: list[dict] | None = None
    """Each item's log-likelihoods and outcome, with [eval] log_samples."""


def load_tasks(cfg, tokenizer, seq_len: int) -> list[Task]:
    """Every task of `cfg.tasks`, read, rendered and tokenized; the problems of all of them as
    one ConfigError, before training starts."""
    tasks, problems = [], []
    for path in cfg.tasks:
        try:
            spec = load_task_spec(path)
            tasks.append(
                build_task(
                    spec,
                    tokenizer,
                    max_len=seq_len,
                    max_items=cfg.max_examples,
                    add_bos=cfg.add_bos,
                )
            )
        except TaskError as e:
            problems.append(f"[eval] tasks: {e}")
    names = [t.spec.name for t in tasks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        problems.append(
            f"[eval] tasks: more than one task is named {', '.join(repeated)}; rename one"
        )
    if problems:
        raise ConfigError(problems)
    return tasks


class TaskEvaluator:
    """Scores `[eval] tasks` on the model as it trains (see the module docstring)."""

    def __init__(self, cfg, tasks: list[Task], *, pad_id: int, seq_len: int, fixed_shape: bool,
                 pp_rows: int, dp_rank: int, dp_world: int, cp: int):  # fmt: skip
        self.cfg = cfg
        self.tasks = tasks
        self.pad_id = pad_id
        self.seq_len = seq_len
        self.fixed_shape = fixed_shape
        # Under PP the schedule takes pieces of training.local_batch_size rows.
        self.rows = cfg.local_batch_size
        if pp_rows:
            self.rows = math.ceil(self.rows / pp_rows) * pp_rows
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.multiple = 2 * cp  # context parallel's load balancing cuts 2 x cp chunks
        for task in tasks:
            log.info(
                "eval task %s (%s): %d items, %d requests, %d forwards of %d rows per rank",
                task.spec.name, task.spec.kind, len(task.items), len(task.requests),
                self.forwards(task), self.rows,
            )  # fmt: skip

    def due(self, step: int, last: bool) -> bool:
        return bool(self.tasks) and (step % self.cfg.freq == 0 or (last and self.cfg.at_end))

    def forwards(self, task: Task) -> int:
        batches = math.ceil(len(task.requests) / self.rows)
        return math.ceil(batches / self.dp_world)

    def _batches(self, task: Task) -> list[list[int]]:
        """This rank's forwards: lists of request indices (longest first), dealt round the
        data-parallel ranks; [] for a forward of padding."""
        order = sorted(range(len(task.requests)), key=lambda i: -task.requests[i].length)
        chunks = [order[i : i + self.rows] for i in range(0, len(order), self.rows)]
        mine = chunks[self.dp_rank :: self.dp_world]
        return mine + [[]] * (self.forwards(task) - len(mine))

    def _tensors(self, task: Task, indices: list[int], device) -> tuple[torch.Tensor, ...]:
        longest = max((task.requests[i].length for i in indices), default=1)
        if self.fixed_shape:
            width = self.seq_len
        else:
            width = min(self.seq_len, math.ceil(longest / 64) * 64)
            width = math.ceil(width / self.multiple) * self.multiple
        inputs = torch.full((self.rows, width), self.pad_id, dtype=torch.long)
        labels = torch.full((self.rows, width), IGNORE_INDEX, dtype=torch.long)
        for row, i in enumerate(indices):
            r = task.requests[i]
            tokens = list(r.context) + list(r.continuation)
            n = len(tokens) - 1
            inputs[row, :n] = torch.tensor(tokens[:-1])
            k = len(r.continuation)
            labels[row, n - k : n] = torch.tensor(r.continuation)
        return inputs.to(device), labels.to(device)

    @torch.no_grad()
    def run(self, runtime, parts) -> list[TaskResult]:
        for part in parts:
            part.eval()
        try:
            return [self._run_task(task, runtime, parts) for task in self.tasks]
        finally:
            for part in parts:
                part.train()

    def _run_task(self, task: Task, runtime, parts) -> TaskResult:
        start = time.perf_counter()
        device = runtime.device
        # Each rank fills its own requests' rows; the sum over the data-parallel ranks gathers
        # them, and over the context-parallel ones adds each piece of a row.
        table = torch.zeros(len(task.requests), 2, dtype=torch.float32, device=device)
        batches = self._batches(task)
        for indices in batches:
            inputs, labels = self._tensors(task, indices, device)
            rows = runtime.eval_rows(parts, inputs, labels)
            if indices:
                table[torch.tensor(indices, device=device)] = rows[: len(indices)]
        table = runtime.reduce_sum(table).cpu()
        loglik = (-table[:, 0]).tolist()
        greedy = (table[:, 1] == 0).tolist()
        return TaskResult(
            task.spec.name,
            score(task, loglik, greedy),
            len(task.items),
            len(task.requests),
            len(batches),
            time.perf_counter() - start,
            samples(task, loglik, greedy) if self.cfg.log_samples else None,
        )


def report(
    results: list[TaskResult], step: int, metrics, dump: str, rank: int, run_id: str = ""
) -> None:
    """The log line, TensorBoard/W&B scalars (`eval/<task>/<metric>`) and the results file."""
    scalars = {}
    for r in results:
        shown = " ".join(f"{k} {v:.4f}" for k, v in r.scores.items())
        log.info(
            "step %4d | eval %s | %s | %d items, %d requests, %d forwards per rank, %.1fs",
            step, r.name, shown, r.items, r.requests, r.forwards, r.seconds,
        )  # fmt: skip
        scalars.update({f"eval/{r.name}/{k}": v for k, v in r.scores.items()})
    metrics.log_scalars(step, scalars)
    if rank == 0:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, RESULTS_FILE), "a") as f:
            for r in results:
                row = {"run_id": run_id, "step": step, "task": r.name, **r.scores, "items": r.items,
                       "requests": r.requests, "forwards": r.forwards,
                       "seconds": round(r.seconds, 3)}  # fmt: skip
                f.write(json.dumps(row) + "\n")
        for r in results:
            if r.samples is not None:
                folder = os.path.join(dump, "eval_samples", f"step-{step}")
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, f"{r.name}.jsonl"), "w") as f:
                    f.writelines(json.dumps(row) + "\n" for row in r.samples)


__all__ = ["RESULTS_FILE", "TaskEvaluator", "TaskResult", "load_tasks", "report"]
