"""The trainer's shape that issue 29 asks to keep: the train loop knows nothing of fault
tolerance (a step coordinator carries it), its files read in one sitting and its functions on
one screen, and the throughput bench times the trainer's own step, not a copy of it. Reads the
sources only (no torch import)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "src" / "titan_trainer"
BENCH = Path(__file__).resolve().parents[3] / "bench" / "throughput.py"
LOOP = ("train.py", "step.py", "run.py", "window.py", "stopping.py", "restarts.py")
LOOP += ("fault_tolerance.py", "cli.py")


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_the_train_loop_has_no_fault_tolerance_branch_and_short_functions():
    train = (TRAINER / "train.py").read_text()
    assert re.findall(r"replicas|semi_sync", train) == []
    assert len(train.splitlines()) < 500
    long = [(name, n) for f in LOOP for name, n in _functions(TRAINER / f) if n > 80]
    assert long == [], long


def test_the_throughput_bench_calls_the_trainers_step():
    bench = BENCH.read_text()
    assert "from titan_trainer.step import train_step" in bench
    assert "_contexts" not in bench and ".backward()" not in bench
