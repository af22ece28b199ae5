"""This machine as a system to price a step on (`[dry_run] system = "cpu"`), measured.

A CPU run of the trainer (the tests, the accuracy benchmarks) is `processes` gloo processes of
one thread each (`titan_trainer.dry_run.accuracy`), so every figure is a single thread's:

- peak: the fastest fp32 square matmul on one thread (`titan_core.flops.measure_matmul_flops`);
  the matmul efficiency is what a training step's matmuls reach of it (each linear layer's
  forward, input gradient and weight gradient, laid out as autograd runs them, at two model
  widths), measured too;
- attention: one thread's causal attention kernel, forward and backward, at head dimensions
  16, 64 and 128 and sequences of 512 and 1024, its traced FLOPs and score elements (as `StepTrace` counts them) fitted by
  least squares to FLOPs at a rate plus a cost per score element (the softmax's work, which
  dominates at small head dimensions); the rate over the matmul peak is its efficiency;
- memory bandwidth: one thread adding two tensors far larger than the caches (3 x the bytes);
- per-operator overhead: a small autograd graph of tiny tensors, forward and backward, timed
  and divided by the aten operators it dispatches (counted as the step trace counts them);
  the same graph on DTensors sharded over two processes gives what each operator on DTensors
  costs on top (tensor parallel's);
- the links: two local gloo processes over loopback timing all-reduces, all-gathers,
  reduce-scatters and all-to-alls from 1 KiB to 32 MiB, fitted by least squares to the ring's
  alpha-beta cost that `titan_trainer.dry_run.step_time` prices (one latency per ring step,
  the bytes at a bus bandwidth): one link for all (both of the system's links are loopback,
  `devices_per_node` is large) and one per kind (`System.links_by_kind`: gloo's
  reduce-scatter reaches under half the bandwidth of its all-reduce);
- no overlap (gloo's collectives block the process), and each rank's share of a core
  measured: `processes` gloo processes running a mix of a step's work at once (a matmul, an
  attention, an out-of-cache add), each's rate over one process's alone (processes beyond the
  free cores share them; all share caches and memory bandwidth; other work on the machine
  takes its part); among processes that share cores, a collective's latency is at least what
  a tiny all-reduce among them took.

Measured once per process (a few seconds), then cached.
"""

from __future__ import annotations

import functools
import itertools
import os
import platform
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from titan_trainer.dry_run.hardware import Link, System
from titan_trainer.dry_run.step_time import ring_terms

_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24, 1 << 25)
"""Bytes of the collectives timed for the links' fits (1 KiB to 32 MiB: a tensor parallel
activation to a 100M-scale model's FSDP block)."""
_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def measured_cpu_system(processes: int = 1, free: float | None = None) -> System:
    """This machine, measured (see the module docstring), for `processes` ranks of one thread.
    Each rank's share of a core is measured now (`measure_compute_share`: the cores, what
    other processes keep busy, the cost of sharing a core); with `free`, the cores the job
    had (measured over a run), it is min(1, free / processes) instead."""
    base = _measured()
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    provenance = dict(base.provenance)
    link, by_kind = base.intra_node, base.links_by_kind
    if free is None:
        measured, call, exchange = measure_compute_share(processes)
        # More processes than cores time-share them: each gets at most cores / processes of
        # one. The mix can measure more (while some wait on the others at its collectives,
        # the rest compute faster); a step, mostly computing, leaves less of that slack.
        share = min(measured, cores / max(processes, 1))
        provenance["compute_share"] = (
            f"measured: {processes} communicating 1-thread processes' rate over one's "
            f"(matmul, attention, memory): {measured:.3f}; at most {cores} cores / "
            f"{processes} processes: {share:.3f}"
        )
        if processes > 1:
            # A collective among processes that share cores waits for each to be scheduled:
            # the latency one tiny all-reduce (2 (n - 1) ring steps) took among them.
            latency = call / (2 * (processes - 1)) * 1e6
            if latency > link.latency_us:
                link = replace(link, latency_us=latency)
                provenance["links"] += (
                    f"; latency at least {latency:.0f} us: a tiny all-reduce among "
                    f"{processes} busy processes on this machine, measured"
                )
            # And its bytes move slower where the processes outnumber the cores: gloo's copies
            # are the processes' own work. The all-gather timed among them, over what the
            # idle pair's fit says it takes, slows every kind's bandwidth.
            alone = by_kind["all_gather"]
            latencies, share = ring_terms("all_gather", processes)
            expected = latencies * alone.latency_us * 1e-6 + share * _EXCHANGE_BYTES / (
                alone.bandwidth_gbps * 1e9
            )
            slower = max(1.0, exchange / expected)
            by_kind = {
                kind: Link(k.bandwidth_gbps / slower, max(k.latency_us, latency))
                for kind, k in by_kind.items()
            }
            if slower > 1:
                link = replace(link, bandwidth_gbps=link.bandwidth_gbps / slower)
            provenance["links"] += (
                f"; bandwidth / {slower:.2f}: a {_EXCHANGE_BYTES >> 20} MiB all-gather among "
                f"{processes} busy processes, {exchange * 1e3:.1f} ms against "
                f"{expected * 1e3:.1f} ms by the idle fit, measured"
            )
    else:
        share = min(1.0, free / max(processes, 1))
        provenance["compute_share"] = (
            f"min(1, {free:.2f} free of {cores} cores / {processes} processes): {share:.3f}"
        )
    return replace(
        base,
        compute_share=share,
        intra_node=link,
        inter_node=link,
        links_by_kind=by_kind,
        provenance=provenance,
    )


_SHARE_ITERATIONS = 30


def measured_cpu_system_elsewhere(processes: int = 1) -> System:
    """`measured_cpu_system` run in a process of its own: the measurement runs torch's kernels
    (threads) and gloo groups, which must not happen in a dry run's process that later forks
    simulations from itself (`--dry_run.search`)."""
    import concurrent.futures

    from titan_trainer.dry_run.simulate import fresh_processes

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=fresh_processes()) as pool:
        return pool.submit(measured_cpu_system, processes).result()


_EXCHANGE_BYTES = 8 << 20
"""The all-gather (its output) each round of `measure_compute_share` times among busy
processes: a block's FSDP all-gather or a tensor parallel activation of a small model."""


def measure_compute_share(processes: int) -> tuple[float, float, float]:
    """(the share of a core each of `processes` one-thread gloo processes gets now, the
    seconds a tiny all-reduce among them takes, the seconds an all-gather of `_EXCHANGE_BYTES`
    takes just after it): each runs the same mix of a step's work (`_mix_and_sync`) with the
    two collectives after each round (the ranks keep step as a job's do; the tiny one takes
    their skew); the share is its rate over one process's alone on the machine, below 1 where
    the processes outnumber the free cores (other work counted) or take caches and memory
    bandwidth from each other."""
    from titan_trainer.dry_run.simulate import fresh_processes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _mix_rate(None)
    finally:
        torch.set_num_threads(threads)
    context = fresh_processes()
    with tempfile.TemporaryDirectory() as tmp:
        results = context.Queue()
        procs = [
            context.Process(target=_share_worker, args=(rank, processes, tmp, results))
            for rank in range(processes)
        ]
        for p in procs:
            p.start()
        measured = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    rates, calls, exchanges = zip(*measured, strict=True)
    return (
        min(1.0, sum(rates) / len(rates) / alone),
        sum(calls) / len(calls),
        sum(exchanges) / len(exchanges),
    )


def _mix_rate(sync) -> float:
    return _mix_and_sync(sync)[0]


def _mix_and_sync(sync, exchange=None) -> tuple[float, float, float]:
    """(iterations per second of a step's mix of work, seconds per `sync` call, seconds per
    `exchange` call), each iteration the mix then `sync` then `exchange`: a step-shaped matmul, a causal attention's forward and
    an out-of-cache add (compute-, cache- and memory-bound work in about a step's
    proportions), so that what processes sharing a machine take from each other (cores,
    caches, memory bandwidth) is all in the rate."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4096, 256, generator=generator), torch.randn(256, 768, generator=generator)
    q = torch.randn(2, 8, 512, 64, generator=generator)
    x, y, out = (torch.randn(1 << 22, generator=generator) for _ in range(3))

    def mix() -> None:
        torch.mm(a, b)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.add(x, y, out=out)

    mix()
    computing = syncing = exchanging = 0.0
    for _ in range(_SHARE_ITERATIONS):
        start = time.perf_counter()
        mix()
        middle = time.perf_counter()
        if sync is not None:
            sync()
        synced = time.perf_counter()
        if exchange is not None:
            exchange()
        computing += middle - start
        syncing += synced - middle
        exchanging += time.perf_counter() - synced
    n = _SHARE_ITERATIONS
    return n / computing, syncing / n, exchanging / n


def _share_worker(rank: int, processes: int, tmp: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=processes
    )
    try:
        flag = torch.zeros(1)
        shard = torch.ones(_EXCHANGE_BYTES // 4 // processes)
        gathered = torch.empty(shard.numel() * processes)
        dist.barrier()
        results.put(
            _mix_and_sync(
                lambda: dist.all_reduce(flag),
                lambda: dist.all_gather_into_tensor(gathered, shard),
            )
        )
    finally:
        dist.destroy_process_group()


@functools.cache
def _measured() -> System:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = measure_single_thread_matmul()
        step_flops = measure_step_matmuls()
        bandwidth = measure_memory_bandwidth()
        overhead = measure_op_overhead()
        attention_rate, score_seconds = measure_attention()
    finally:
        torch.set_num_threads(threads)
    link, by_kind, (dtensor_seconds, ops, dtensor_ops) = measure_gloo_link()
    # What the DTensor graph took beyond its operators' own dispatch, per DTensor operator.
    dtensor_overhead = max(0.0, (dtensor_seconds - ops * overhead) / max(dtensor_ops, 1))
    cpu = _cpu_name()
    return System(
        name=f"cpu ({cpu}, 1 thread per process, measured)",
        device=cpu,
        devices_per_node=1 << 20,
        peak_tflops={"fp32": flops / 1e12, "bf16": flops / 1e12},
        memory_bandwidth_gbps=bandwidth / 1e9,
        matmul_efficiency=min(1.0, step_flops / flops),
        attention_efficiency=min(1.0, attention_rate / flops),
        attention_score_ns=score_seconds * 1e9,
        dtensor_op_overhead_us=dtensor_overhead * 1e6,
        memory_efficiency=1.0,
        op_overhead_us=overhead * 1e6,
        intra_node=link,
        inter_node=link,
        overlap=False,
        compute_share=1.0,
        links_by_kind=by_kind,
        provenance={
            "peak_tflops": f"measured: fastest fp32 square matmul on 1 thread, "
            f"{flops / 1e9:.1f} GFLOP/s",
            "attention": f"measured: 1-thread causal attention forward and backward at head "
            f"dimensions 16, 64, 128, sequences 512, 1024: {attention_rate / 1e9:.1f} GFLOP/s (traced FLOPs) plus "
            f"{score_seconds * 1e9:.2f} ns per score element",
            "memory": f"measured: 1-thread add of 3 x 64 MiB tensors, {bandwidth / 1e9:.1f} GB/s",
            "op_overhead_us": f"measured: tiny autograd ops, {overhead * 1e6:.1f} us per aten op",
            "dtensor_op_overhead_us": f"measured: tiny autograd ops on DTensors over 2 gloo "
            f"processes, {dtensor_overhead * 1e6:.1f} us per DTensor op beyond the aten op's",
            "links": f"measured: 2 gloo processes over loopback, all_reduce and all_gather of "
            f"{_SIZES[0]}..{_SIZES[-1]} bytes, alpha-beta least squares: "
            f"{link.latency_us:.1f} us, {link.bandwidth_gbps:.2f} GB/s; each kind's own fit "
            "(all_reduce, all_gather, reduce_scatter, all_to_all): "
            + ", ".join(
                f"{kind} {k.latency_us:.0f} us {k.bandwidth_gbps:.2f} GB/s"
                for kind, k in by_kind.items()
            ),
            "matmul_efficiency": f"measured: 1-thread matmuls of a training step's linear "
            f"layers (forward, input and weight gradients as autograd lays them out), "
            f"{step_flops / 1e9:.1f} GFLOP/s",
            "efficiency": "memory 1.0 (the bandwidth is this machine's, measured); matmul and "
            "attention: their measured rates over the square matmul peak",
        },
        source="titan_trainer.dry_run.cpu_system",
    )


def measure_single_thread_matmul() -> float:
    from titan_core.flops import measure_matmul_flops

    return measure_matmul_flops(torch.device("cpu"), torch.float32, min_seconds=0.3)


# A training step's linear layers: (tokens, in features, out features) at the widths of small
# and 100M-scale models, a projection as wide as the model and one three times wider.
_STEP_LINEARS = [(4096, width, out) for width in (256, 768) for out in (width, 3 * width)]


def measure_step_matmuls(repeats: int = 5) -> float:
    """FLOP/s of one thread over a training step's matmuls (the fastest of `repeats` each,
    total FLOPs over total seconds): each linear layer's three, laid out as autograd runs them
    (the forward x @ W.T, the input gradient g @ W, the weight gradient g.T @ x: BLAS is
    slower on some transposed operands), what the square peak's efficiency is in a step."""
    generator = torch.Generator().manual_seed(0)
    flop = seconds = 0.0
    for tokens, width, out in _STEP_LINEARS:
        x = torch.randn(tokens, width, generator=generator)
        w = torch.randn(out, width, generator=generator)
        g = torch.randn(tokens, out, generator=generator)
        for a, b in ((x, w.t()), (g, w), (g.t(), x)):
            torch.mm(a, b)
            seconds += min(_timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(repeats))
            flop += 2 * tokens * width * out
    return flop / seconds


def measure_attention(width: int = 512) -> tuple[float, float]:
    """(FLOP/s, seconds per score element) of one thread's causal attention, forward and
    backward: time = traced FLOPs / rate + traced score elements x cost, fitted over head
    dimensions 16, 64 and 128 (the same FLOPs, 8x apart in score elements) and sequences of
    512 and 1024 tokens (the kernel's blocks differ)."""
    import torch.nn.functional as F

    from titan_trainer.dry_run.step_trace import StepTrace

    generator = torch.Generator().manual_seed(0)
    rows, times = [], []
    for head_dim, seq_len in itertools.product((16, 64, 128), (512, 1024)):
        batch = 2048 // seq_len
        q, k, v = (
            torch.randn(
                batch, width // head_dim, seq_len, head_dim, generator=generator
            ).requires_grad_()
            for _ in range(3)
        )

        def run(q=q, k=k, v=v) -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        trace = StepTrace()
        with trace.phase("attention"):
            run()
        work = trace.work()
        run()
        seconds = min(_timed(run) for _ in range(3))
        rows.append([work.attention_flops, work.attention_scores])
        times.append(seconds)
    a, t = np.array(rows), np.array(times)
    (inv_rate, per_score), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    return 1 / max(float(inv_rate), 1e-15), max(float(per_score), 0.0)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_memory_bandwidth(mib: int = 64, repeats: int = 8) -> float:
    """Bytes per second of an out-of-cache add (two reads, one write), the fastest repeat."""
    n = mib * (1 << 20) // 4
    a, b, out = torch.ones(n), torch.ones(n), torch.empty(n)
    torch.add(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best


def measure_op_overhead(repeats: int = 30) -> float:
    """Seconds per aten operator of a forward and backward over tiny tensors: the fixed cost
    of dispatch, autograd and a kernel's launch, each op's arithmetic negligible."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)

    def graph() -> None:
        h = x
        for _ in range(10):
            h = torch.nn.functional.silu(h @ w) * h + 1.0
        h.sum().backward()
        x.grad = w.grad = None

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten" and func._overloadpacket.__name__ not in _VIEWS:
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        graph()
    for _ in range(3):
        graph()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)) / max(Count.ops, 1)


_VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "detach", "alias", "empty_like"}


def measure_gloo_link() -> tuple[Link, dict[str, Link], tuple[float, int, int]]:
    """Two gloo processes over loopback: the alpha-beta link that fits their all-reduces and
    all-gathers, each collective kind's own fit (gloo's reduce-scatter, for one, costs about
    twice a ring's), and (seconds, operators, operators on DTensors) of a small graph on
    DTensors over the two (`_time_dtensor_graph`)."""
    from titan_trainer.dry_run.simulate import fresh_processes

    context = fresh_processes()
    with tempfile.TemporaryDirectory() as tmp:
        results = context.Queue()
        procs = [
            context.Process(target=_link_worker, args=(rank, tmp, results)) for rank in range(2)
        ]
        for p in procs:
            p.start()
        samples, dtensor = results.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
    general = [s for s in samples if s[0] in ("all_reduce", "all_gather")]
    by_kind = {kind: fit_link([s for s in samples if s[0] == kind], ranks=2) for kind in _KINDS}
    return fit_link(general, ranks=2), by_kind, dtensor


def fit_link(samples: list[tuple[str, int, float]], ranks: int) -> Link:
    """Least squares of (kind, bytes, seconds per call) to the ring's cost:
    passes x ((n - 1) alpha + (n - 1) / n x bytes / bandwidth)."""
    rows, times = [], []
    for kind, size, seconds in samples:
        latencies, share = ring_terms(kind, ranks)
        rows.append([latencies, share * size])
        times.append(seconds)
    # Relative errors: each sample weighted by its own time, the small ones count too.
    a, t = np.array(rows), np.array(times)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    alpha = max(float(alpha), 1e-6)
    inv_bw = max(float(inv_bw), 1e-12)
    return Link(bandwidth_gbps=1 / inv_bw / 1e9, latency_us=alpha * 1e6)


def _link_worker(rank: int, tmp: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        samples = []
        for size in _SIZES:
            full, shard = torch.ones(size // 4), torch.ones(size // 8)
            out = torch.empty(size // 4)
            calls = {
                "all_reduce": lambda full=full: dist.all_reduce(full),
                "all_gather": lambda full=full, shard=shard: dist.all_gather_into_tensor(
                    full, shard
                ),
                "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_tensor(
                    shard, full
                ),
                "all_to_all": lambda full=full, out=out: dist.all_to_all_single(out, full),
            }
            for kind in _KINDS:
                times = []
                for i in range(10 if size < 1 << 24 else 6):
                    dist.barrier()
                    start = time.perf_counter()
                    calls[kind]()
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                # Bytes as the step trace counts them: the full tensor (all-gather's output,
                # reduce-scatter's and all-to-all's input, all-reduce's tensor).
                samples.append((kind, size, float(np.median(times))))
        dtensor = _time_dtensor_graph()
        if rank == 0:
            results.put((samples, dtensor))
    finally:
        dist.destroy_process_group()


def _time_dtensor_graph(repeats: int = 20) -> tuple[float, int, int]:
    """(seconds, operators, operators on DTensors) of a small autograd graph on tiny DTensors
    sharded over this 2-rank group (no communication in it), operators as `StepTrace` counts
    them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from titan_trainer.dry_run.step_trace import StepTrace

    mesh = init_device_mesh("cpu", (2,))
    x = distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]).requires_grad_()

    def graph() -> None:
        h = x
        for _ in range(5):
            h = torch.nn.functional.silu(h @ w) * h + 1.0
        h.to_local().sum().backward()
        x.grad = w.grad = None

    for _ in range(3):
        graph()
    trace = StepTrace()
    with trace.phase("dtensor"):
        graph()
    work = trace.work()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        graph()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples)), work.compute_ops, work.dtensor_ops


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"
