"""Long context over packed documents: one process against ring and all-to-all context parallel.

One attention layer's forward and backward (block-causal over packed documents, fp32, grouped
key/value heads) per step, on real gloo process groups of CP 2 and CP 4 on this machine's CPU:

- `one process`: the whole sequence, the mask run as titan-models' `varlen` path does on a CPU
  (causal attention per document: no seq x seq mask);
- `ring`: `titan_parallel.document_ring` (the documents' dealing, each pair of chunks under its
  own mask, empty pairs skipped), with the dealing's imbalance beside the head-and-tail one and
  the share of causal chunk pairs skipped;
- `all-to-all`: `titan_parallel.alltoall_attention` around the same per-document attention
  over the whole sequence with heads / CP of them.

Document lengths are log-normal (median `--median` tokens, sigma `--sigma`), packed one after
another. Each record is one (sequence length, layout): the median step over `--steps` (the
slowest rank's), after one untimed step. The ranks of a CP group share this machine's cores:
CP 4 on 2 cores runs two ranks per core, so compare the styles at one CP degree, and read the
skipped share and imbalance as the work each rank is spared.
"""

from __future__ import annotations

import argparse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="8192,16384,32768", help="sequence lengths, comma-separated")
    p.add_argument("--cps", default="2,4", help="context-parallel degrees, comma-separated")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--median", type=float, default=1024.0, help="median document length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the lengths")
    p.add_argument("--steps", type=int, default=3, help="timed steps per record")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from titan_core import HeadAttention  # noqa: E402
from titan_models.block_causal import attend_block_causal, build_attention_mask  # noqa: E402
from titan_parallel.alltoall_attention import alltoall_scope, apply_alltoall_cp  # noqa: E402
from titan_parallel.document_ring import (  # noqa: E402
    head_tail_imbalance,
    plan_document_ring,
    ring_document_attention,
)


def packed_ids(seq: int, median: float, sigma: float, seed: int) -> torch.Tensor:
    """`[1, seq]` document ids of log-normal documents packed one after another."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = max(1, round(float(torch.empty(1).log_normal_(math.log(median), sigma, generator=g))))
        n = min(n, seq - total)
        lengths.append(n)
        total += n
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def qkv(args, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = (args.heads, args.kv_heads, args.kv_heads)
    return [torch.randn(1, h, seq, args.head_dim, generator=g) for h in shapes]


def per_document(q, k, v, ids):
    """Block-causal attention as titan-models runs it on a CPU (causal SDPA per document)."""
    mask = build_attention_mask(ids, impl="varlen")
    return attend_block_causal(q, k, v, mask)


def timed(fn, steps: int) -> list[float]:
    fn()  # untimed: first-call allocations
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def step_of(attend, tensors):
    def step():
        q, k, v = (t.detach().requires_grad_() for t in tensors)
        out = attend(q, k, v)
        out.backward(torch.ones_like(out))

    return step


class _Layer(nn.Module, HeadAttention):
    def __init__(self, heads: int, kv: int, ids: torch.Tensor) -> None:
        super().__init__()
        self.heads, self.ids = (heads, kv), ids

    def attend(self, q, k, v, mask):
        return per_document(q, k, v, self.ids)

    def attention_heads(self):
        return self.heads


def _rank(rank: int, cp: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    for seq in [int(s) for s in args.seqs.split(",")]:
        ids = packed_ids(seq, args.median, args.sigma, args.seed)
        q, k, v = qkv(args, seq, args.seed)
        plan = plan_document_ring(ids, cp, rank)
        mine = plan.positions(rank)
        ring = step_of(
            lambda a, b, c, plan=plan: ring_document_attention(a, b, c, plan, mesh.get_group()),
            [t[:, :, mine] for t in (q, k, v)],
        )
        layer = _Layer(args.heads, args.kv_heads, ids)
        apply_alltoall_cp(layer, mesh)
        n = seq // cp

        def alltoall_attend(a, b, c, layer=layer):
            with alltoall_scope():
                return layer.attend(a, b, c, None)

        alltoall = step_of(alltoall_attend, [t[:, :, rank * n : (rank + 1) * n] for t in (q, k, v)])
        for style, step in (("ring", ring), ("all-to-all", alltoall)):
            dist.barrier()
            times = torch.tensor(timed(step, args.steps))
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if rank == 0:
                record = {
                    "seq": seq,
                    "layout": f"CP {cp} {style}",
                    "s_per_step": statistics.median(times.tolist()),
                }
                if style == "ring":
                    record.update(
                        imbalance=round(plan.imbalance, 4),
                        head_tail_imbalance=round(head_tail_imbalance(ids, cp), 4),
                        skipped_block_share=round(plan.skipped_block_share, 4),
                        chunks_per_rank=len(plan.owned[0]),
                    )
                queue.put(record)
    dist.destroy_process_group()


def run_cp(cp: int, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, args, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    records = [queue.get(timeout=3600) for _ in range(2 * len(args.seqs.split(",")))]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise SystemExit(f"a CP {cp} rank failed (exit {p.exitcode})")
    return records


def main(args) -> None:
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }
    torch.set_num_threads(1)
    for seq in [int(s) for s in args.seqs.split(",")]:
        ids = packed_ids(seq, args.median, args.sigma, args.seed)
        tensors = qkv(args, seq, args.seed)
        times = timed(
            step_of(lambda a, b, c, ids=ids: per_document(a, b, c, ids), tensors), args.steps
        )
        docs = int(ids.max()) + 1
        print(
            json.dumps(
                {
                    "seq": seq,
                    "layout": "one process",
                    "s_per_step": statistics.median(times),
                    "documents": docs,
                    **machine,
                }
            ),
            flush=True,
        )
    for cp in [int(c) for c in args.cps.split(",")]:
        for record in run_cp(cp, args):
            print(json.dumps({**record, **machine}), flush=True)


if __name__ == "__main__":
    main(ARGS)
