"""Lines that say how far long work has got: each part as it finishes, with the time it took
and an estimate of what is left from the parts done so far. They go to stderr, flushed at
once, so that a command whose answer goes to stdout (a table, JSON lines) is never silent for
minutes and its answer stays clean."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class Progress:
    """`total` parts of work called `what` (the prefix of every line). `out` takes each line
    (default: stderr, flushed; a process doing part of the work may pass its lines on to the
    one that speaks)."""

    def __init__(self, what: str, total: int, out: Callable[[str], object] | None = None):
        self.what, self.total, self.count = what, total, 0
        self.start = time.perf_counter()
        self.out = out or _to_stderr

    def say(self, text: str) -> None:
        self.out(f"{self.what}: {text}")

    def mark(self, text: str) -> None:
        """`text`, with the time since the work started (parts of unequal length)."""
        self.say(f"{text} ({duration(time.perf_counter() - self.start)} in)")

    def done(self, part: str) -> None:
        """`part` has finished: how many are done, in how long, and about how long the rest
        take at the pace so far."""
        self.count += 1
        elapsed = time.perf_counter() - self.start
        left = self.total - self.count
        rest = f"; about {duration(elapsed / self.count * left)} left" if left > 0 else ""
        self.say(f"{part} ({self.count} of {self.total} done in {duration(elapsed)}{rest})")


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
