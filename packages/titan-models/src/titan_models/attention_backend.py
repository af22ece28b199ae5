"""Which SDPA kernel runs causal attention, chosen per shape by measuring it.

`F.scaled_dot_product_attention` picks its kernel by a fixed priority (on CUDA flash, then
memory-efficient, then cuDNN, then math), which is not always the fastest for a shape: cuDNN's
attention often beats flash at long sequences, and a kernel that refuses grouped-query
attention read in place (`enable_gqa`) falls through to a slower one. Here each candidate
kernel of a device runs forward and backward on the exact shape, and the fastest wins:

- `attention_candidates(device)`: the kernels worth trying there (CUDA: flash, cuDNN,
  memory-efficient, math; CPU: flash, math);
- `SDPAChoice(backend, repeat_kv)`: one way to run it; `repeat_kv` repeats the key/value
  heads for a kernel that refuses them grouped;
- `runnable_choice(name, shape, dtype, device)`: a named kernel as it runs the shape (grouped
  heads in place if it takes them, else repeated), or the reason it cannot;
- `choose_attention_backend(...)`: the timings of every candidate that runs, the fastest
  first (cached per shape, dtype and device);
- `set_attention_backend(model, choice)`: every attention layer of a model (a module that
  inherits `TakesSDPAKernel`, as `GroupedQueryAttention` does) runs its causal attention with
  it; None is torch's own dispatch. A plain attribute, so it survives building on the meta device
  and is read when a compiled block is traced (dynamo traces `sdpa_kernel`, torch 2.11 on).

Only causal attention without a mask is steered; block-causal masks keep their own
implementations (`titan_models.block_causal`).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionChoice",
    "AttentionShape",
    "SDPAChoice",
    "TakesSDPAKernel",
    "attention_candidates",
    "choose_attention_backend",
    "run_attention",
    "runnable_choice",
    "set_attention_backend",
]

AttentionBackendName = Literal["flash", "cudnn", "efficient", "math"]
ATTENTION_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_CANDIDATES = {"cuda": ("flash", "cudnn", "efficient", "math"), "cpu": ("flash", "math")}
# The math kernel holds the whole [batch, heads, seq, seq] score matrix (and its softmax and
# their gradients, in float32): past this it is not timed, since it cannot win there and could
# take the memory the run needs.
MATH_SCORES_LIMIT = 1 << 30
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)")


@dataclasses.dataclass(frozen=True)
class SDPAChoice:
    """One way to run causal SDPA: under `sdpa_kernel(backend)`, the key/value heads read in
    place (grouped-query attention) or, with `repeat_kv`, repeated to the query heads first."""

    backend: SDPBackend
    repeat_kv: bool = False

    @property
    def name(self) -> str:
        name = next(n for n, b in ATTENTION_BACKENDS.items() if b == self.backend)
        return f"{name} (k/v repeated)" if self.repeat_kv else name


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One rank's attention: `batch` sequences of `seq` tokens, `heads` query heads and
    `kv_heads` key/value heads of `head_dim`."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int

    def __str__(self) -> str:
        kv = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"{self.batch}x{self.seq}, {self.heads}{kv} heads of {self.head_dim}"


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """What `choose_attention_backend` measured: `best`, and the seconds of one forward and
    backward of each candidate that ran (`timings`, by name, fastest first); `skipped`: the
    candidates that did not run, with the reason."""

    best: SDPAChoice
    timings: dict[str, float]
    skipped: dict[str, str]

    def summary(self) -> str:
        """For a log: each candidate's time, fastest first, then the skipped ones and why."""
        ran = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in self.timings.items())
        return ran + "".join(f"; {n} not run: {why}" for n, why in self.skipped.items())


def attention_candidates(device: torch.device | str) -> tuple[str, ...]:
    """The SDPA kernels worth timing on `device`'s type (every one torch has elsewhere)."""
    return _CANDIDATES.get(torch.device(device).type, tuple(ATTENTION_BACKENDS))


def run_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, choice: SDPAChoice | None
) -> torch.Tensor:
    """Causal attention of `[batch, heads, seq, head_dim]` tensors with `choice` (None:
    torch's own dispatch). Keys and values may have fewer heads than the queries."""
    if choice is not None and choice.repeat_kv and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    gqa = k.shape[1] != q.shape[1]
    if choice is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    with sdpa_kernel(choice.backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _inputs(shape: AttentionShape, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(
        shape.batch, shape.heads, shape.seq, shape.head_dim, generator=gen, device=device
    )
    k = torch.randn(shape.batch, shape.kv_heads, shape.seq, shape.head_dim, generator=gen, device=device)  # fmt: skip
    v = torch.randn_like(k)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _forward_backward(inputs, choice: SDPAChoice | None) -> None:
    out = run_attention(*inputs, choice)
    torch.autograd.grad(out, inputs, torch.ones_like(out))


def runnable_choice(
    name: str, shape: AttentionShape, dtype: torch.dtype, device: torch.device | str
) -> tuple[SDPAChoice | None, str]:
    """The named kernel (a key of `ATTENTION_BACKENDS`) as it runs `shape` in `dtype` on
    `device`, forward and backward: with grouped key/value heads read in place if it takes
    them, else repeated; or (None, why not) when it cannot run the shape at all."""
    device = torch.device(device)
    there = attention_candidates(device)
    if name not in there:
        return None, f"torch has no {name} kernel on {device.type} (it has {', '.join(there)})"
    if name == "math":
        scores = shape.batch * shape.heads * shape.seq * shape.seq * 4
        if scores > MATH_SCORES_LIMIT:
            return None, f"its score matrix would hold {scores / 2**30:.1f} GiB"
    inputs = _inputs(shape, dtype, device)
    ways = [False, True] if shape.kv_heads != shape.heads else [False]
    why = ""
    for repeat in ways:
        choice = SDPAChoice(ATTENTION_BACKENDS[name], repeat)
        # torch says why a kernel refuses a shape in warnings ("... not used because:", then
        # the reason), then raises "No available kernel": keep what the warnings say.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _forward_backward(inputs, choice)
                return choice, ""
            except RuntimeError as error:
                said = " ".join(_TRIGGERED.sub("", str(w.message)).strip() for w in caught)
                why = why or said or str(error).split("\n")[0]
    return None, why


def _time(
    inputs, choice: SDPAChoice, device: torch.device, warmup: int, reps: int, best: float
) -> float:
    """The median seconds of `reps` runs after `warmup`; a kernel whose first timed run takes
    more than twice `best` (the fastest so far) stops there: it cannot win, and a slow
    kernel's runs are the dearest part of the choice (math at 8 x 1024 tokens on a CPU: 2.3 s
    a run against flash's 0.24)."""

    def timed() -> float:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        start = time.perf_counter()
        _forward_backward(inputs, choice)
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter() - start

    for _ in range(warmup):
        _forward_backward(inputs, choice)
    times = [timed()]
    if times[0] > 2 * best:
        return times[0]
    times += [timed() for _ in range(reps - 1)]
    return statistics.median(times)


_CACHE: dict[tuple, AttentionChoice] = {}


def choose_attention_backend(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    warmup: int = 0,
    reps: int = 3,
    candidates: tuple[str, ...] | None = None,
) -> AttentionChoice:
    """Times causal attention forward + backward of this shape with each of the device's
    candidate kernels and returns the timings, the fastest as `best`. `candidates`: names of
    `ATTENTION_BACKENDS` (default `attention_candidates(device)`). The run that checks a
    kernel can run the shape warms it up; then `warmup` more untimed runs and the median of
    `reps` timed ones, the device synchronised around each (one timed run only for a kernel
    already twice as slow as the fastest so far). A kernel that cannot run the shape is
    skipped with its reason; when none can, a RuntimeError. The result is kept per (shape,
    dtype, device, warmup, reps, candidates)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = AttentionShape(batch, heads, kv_heads, seq, head_dim)
    candidates = tuple(candidates or attention_candidates(device))
    key = (shape, dtype, device, warmup, reps, candidates)
    if key in _CACHE:
        return _CACHE[key]
    timings: dict[SDPAChoice, float] = {}
    skipped: dict[str, str] = {}
    inputs = _inputs(shape, dtype, device)
    for name in candidates:
        choice, why = runnable_choice(name, shape, dtype, device)
        if choice is None:
            skipped[name] = why
        else:
            best = min(timings.values(), default=float("inf"))
            timings[choice] = _time(inputs, choice, device, warmup, reps, best)
    if not timings:
        raise RuntimeError(
            f"no SDPA kernel runs causal attention of {shape} in {dtype} on {device}: "
            + "; ".join(f"{n}: {why}" for n, why in skipped.items())
        )
    ranked = sorted(timings, key=timings.__getitem__)
    result = AttentionChoice(ranked[0], {c.name: timings[c] for c in ranked}, skipped)
    _CACHE[key] = result
    return result


class TakesSDPAKernel:
    """What an attention layer inherits to run its causal attention on the SDPA kernel
    `set_attention_backend` chooses: it reads `sdpa_backend` (None: torch's dispatch picks)
    when it attends. Declared by inheritance, so that the layers are found by what they are,
    not by an attribute's name."""

    sdpa_backend: SDPAChoice | None = None


def set_attention_backend(model: nn.Module, choice: SDPAChoice | None) -> int:
    """Every attention layer of `model` (a `TakesSDPAKernel`) runs its causal attention with
    `choice` (None: torch's own dispatch); returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, TakesSDPAKernel)]
    for layer in layers:
        layer.sdpa_backend = choice
    return len(layers)
