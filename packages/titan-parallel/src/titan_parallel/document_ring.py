"""Ring context parallel over packed documents: each pair of chunks under its own document mask.

A packed sample holds many documents, and block-causal attention lets a position see only the
earlier positions of its own document. Under ring context parallel every rank keeps a share of
the sequence (queries, keys, values) and the key/value shares travel round the ring, one hop
per step: at step s rank r holds the keys of rank r - s. Here each such pair (my queries, the
keys I hold) is computed under the mask of that pair, built from the document ids and the
global positions of both shares, and its partial result is merged by log-sum-exp. A pair with
no allowed position (a share that ends before the other's documents begin) is not computed:
short documents cost little, however long the packed sequence.

Which positions a rank keeps is decided per batch, from the documents (`plan_document_ring`):
the sequence is cut into `chunks_per_rank x cp` equal chunks, each chunk's work (the allowed
query/key pairs of its queries) is counted, and the chunks are dealt to ranks heaviest first,
each to the rank with the least work so far that still has room. Causal attention over one long
document gives the usual head-and-tail pairing; many short documents give equal shares. The
imbalance (most loaded rank over the mean) of both dealings is what `DocumentRing.imbalance`
and `head_tail_imbalance` report.

The backward runs the ring again: each pair's gradients come from the merged output and
log-sum-exp (exact, as in one process), the query gradient stays home and the key/value
gradients travel with their keys back to their owner. Grouped key/value heads travel once and
are repeated only for the kernel. On the CPU the pairs run the CPU flash kernel with an
additive mask; elsewhere a plain implementation of the same two formulas.

The attention layers are found by what they are (`titan_core.HeadAttention`):
`apply_document_ring_cp` wraps each one's `attend`, and the wrapper runs the ring only inside
`document_ring_scope` (what `cp_context(style="ring", document_ids=...)` opens), where it
ignores the model's own mask: the ring builds each pair's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

from titan_core import DocumentMask, HeadAttention
from titan_parallel.alltoall_attention import gather_sequence_pieces

__all__ = [
    "DocumentRing",
    "apply_document_ring_cp",
    "document_ring_scope",
    "head_tail_imbalance",
    "plan_document_ring",
]

_aten = torch.ops.aten


class _Kernel:
    """`plain`: run the pairs with the plain formulas on the CPU too (the path other devices
    take), so that the CPU tests check it."""

    plain = False


# ----------------------------------------------------------------------------- the plan


@dataclass
class DocumentRing:
    """Where each position goes under ring context parallel over `document_ids`, and which
    pairs of chunks have work. Every rank of the CP group makes the same plan from the same
    batch."""

    ids: torch.Tensor
    """`[batch, seq]` document ids of the whole batch, in sequence order (on the CPU)."""
    cp: int
    rank: int
    size: int
    """Positions per chunk."""
    owned: list[list[int]]
    """The chunks each rank keeps, in sequence order (its share is their concatenation)."""
    work: list[int]
    """Allowed (query, key) pairs of each rank's queries, summed over the batch."""
    blocks: list[list[bool]]
    """`[chunks][chunks]`: some query of chunk i sees some key of chunk j."""
    fake: bool = False
    """Made for fake tensors (the dry run), whose ids cannot be read: planned as one document,
    the ring's most work (no chunk pair skipped)."""
    _masks: dict = field(default_factory=dict, repr=False)

    @property
    def order(self) -> torch.Tensor:
        """`[seq]` the global positions, rank 0's share first."""
        return torch.cat([self.positions(r) for r in range(self.cp)])

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions of `rank`'s share, in its order."""
        return torch.cat(
            [torch.arange(c * self.size, (c + 1) * self.size) for c in self.owned[rank]]
        )

    def pair_blocks(self, source: int) -> list[tuple[int, list[int]]]:
        """For my queries against rank `source`'s keys: each of my chunks (its place in my
        share) with the places of `source`'s chunks it sees; chunks that see none are left out."""
        pairs = []
        for a, qc in enumerate(self.owned[self.rank]):
            seen = [b for b, kc in enumerate(self.owned[source]) if self.blocks[qc][kc]]
            if seen:
                pairs.append((a, seen))
        return pairs

    def for_rows(self, ids: torch.Tensor) -> DocumentRing:
        """The plan for some rows of the batch (`ids`: their `[rows, seq]` document ids): the
        same dealing of positions, the chunk pairs and masks of those rows. Made once per ids
        tensor (one host copy of it), then looked up."""
        if ids is self.ids:
            return self
        key = ("rows", id(ids))
        if key not in self._masks:
            if self.fake or _is_fake(ids):
                plan = replace(self, ids=ids, _masks={})
            else:
                rows = ids.detach().to("cpu")
                plan = (
                    self
                    if torch.equal(rows, self.ids)
                    else replace(
                        self, ids=rows, blocks=_blocks_with_work(rows, len(self.blocks)), _masks={}
                    )
                )
            self._masks[key] = (ids, plan)  # ids kept: its id() stays its own meanwhile
        return self._masks[key][1]

    def has_work(self, rank: int, source: int) -> bool:
        return any(self.blocks[q][k] for q in self.owned[rank] for k in self.owned[source])

    @property
    def imbalance(self) -> float:
        """The most loaded rank's work over the mean (1.0: even)."""
        return _imbalance(self.work)

    @property
    def skipped_block_share(self) -> float:
        """The share of the causal chunk pairs (key chunk not after the query chunk) that hold
        no allowed position and are not computed (0 for one document)."""
        n = len(self.blocks)
        return 1.0 - sum(map(sum, self.blocks)) / (n * (n + 1) // 2)

    def block_mask(self, qc: int, kc: int) -> torch.Tensor | None:
        """`[batch, 1, size, size]` bool for query chunk `qc` against key chunk `kc`, or None
        where every pair is allowed (a chunk of one document before another of it)."""
        key = (qc, kc)
        if self.fake:  # one document: causal on the diagonal, every pair below it
            if qc != kc:
                return None
            if key not in self._masks:
                causal = torch.ones(self.size, self.size, dtype=torch.bool).tril()
                self._masks[key] = causal.expand(self.ids.shape[0], 1, -1, -1)
            return self._masks[key]
        if key not in self._masks:
            q = torch.arange(qc * self.size, (qc + 1) * self.size)
            k = torch.arange(kc * self.size, (kc + 1) * self.size)
            same = self.ids[:, q][:, :, None] == self.ids[:, k][:, None, :]
            allowed = (same & (q[:, None] >= k[None, :]))[:, None]
            self._masks[key] = None if bool(allowed.all()) else allowed
        return self._masks[key]


def _imbalance(work: list[int]) -> float:
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def _query_work(ids: torch.Tensor) -> torch.Tensor:
    """`[seq]` how many keys each position's query sees (its place in its document, from 1),
    summed over the batch (documents are runs of equal ids)."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    start_at = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return (index - start_at + 1).sum(dim=0)


def _blocks_with_work(ids: torch.Tensor, n: int) -> list[list[bool]]:
    """`[n, n]` bool over the chunks: the diagonal, and i > j where a document of chunk j
    goes on into chunk i (documents are runs of equal ids, so it is chunk j's last)."""
    batch, seq = ids.shape
    chunks = ids.reshape(batch, n, seq // n)
    first, last = chunks[:, :, 0], chunks[:, :, -1]
    later = torch.ones(n, n, dtype=torch.bool).tril(-1)
    shared = (first[:, :, None] == last[:, None, :]).any(dim=0)  # [query chunk, key chunk]
    return ((shared & later) | torch.eye(n, dtype=torch.bool)).tolist()


CHUNK_CHOICES = (32, 16, 8, 4)
MIN_CHUNK = 256


def chunks_per_rank(seq: int, cp: int) -> int:
    """How many chunks each rank keeps: the most of `CHUNK_CHOICES` that cut `seq` evenly into
    chunks of at least `MIN_CHUNK` positions, else 2 (the head-and-tail pairing). Smaller
    chunks skip more of what no document spans; each is one kernel call per pair."""
    for k in CHUNK_CHOICES:
        if seq % (k * cp) == 0 and seq // (k * cp) >= MIN_CHUNK:
            return k
    return 2


def plan_document_ring(
    document_ids: torch.Tensor, cp: int, rank: int, *, chunks: int | None = None
) -> DocumentRing:
    """Deal the chunks of the sequence to `cp` ranks by the work their documents make (see the
    module); `chunks` per rank (default `chunks_per_rank`). `seq` must divide by `chunks x cp`.
    Documents are runs of equal ids (as `titan_models.document_ids` numbers them)."""
    seq = document_ids.shape[1]
    k = chunks or chunks_per_rank(seq, cp)
    if seq % (k * cp):
        raise ValueError(f"seq_len {seq} does not divide into {k} chunks x {cp} ranks")
    size, n = seq // (k * cp), k * cp
    if _is_fake(document_ids):
        return _one_document_plan(document_ids, cp, rank, k, size)
    ids = document_ids.detach().to("cpu")
    if bool((ids[:, 1:] < ids[:, :-1]).any()):
        raise ValueError(
            "document ids must not decrease along a row (each document a run of equal ids, as"
            " `(tokens == bos_id).cumsum(-1)` numbers them)"
        )
    chunk_work = _query_work(ids).reshape(n, size).sum(dim=1).tolist()
    owned, loads = _deal(chunk_work, cp, k)
    return DocumentRing(ids, cp, rank, size, owned, loads, _blocks_with_work(ids, n))


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or is_fake(t)


def _one_document_plan(ids: torch.Tensor, cp: int, rank: int, k: int, size: int) -> DocumentRing:
    # Every query of chunk c sees the (c * size + i + 1) keys before it and itself, per row.
    n, batch = k * cp, ids.shape[0]
    work = [batch * (size * c * size + size * (size + 1) // 2) for c in range(n)]
    owned, loads = _deal(work, cp, k)
    blocks = [[kc <= qc for kc in range(n)] for qc in range(n)]
    return DocumentRing(ids, cp, rank, size, owned, loads, blocks, fake=True)


def _deal(chunk_work: list[int], cp: int, k: int) -> tuple[list[list[int]], list[int]]:
    """Heaviest chunk first, each to the least loaded rank with room: (chunks per rank in
    sequence order, work per rank)."""
    loads, owned = [0] * cp, [[] for _ in range(cp)]
    for c in sorted(range(len(chunk_work)), key=lambda c: (-chunk_work[c], c)):
        r = min((r for r in range(cp) if len(owned[r]) < k), key=lambda r: (loads[r], r))
        owned[r].append(c)
        loads[r] += chunk_work[c]
    return [sorted(o) for o in owned], loads


def head_tail_imbalance(document_ids: torch.Tensor, cp: int) -> float:
    """The imbalance of the fixed head-and-tail pairing (rank r keeps chunks r and 2cp-1-r of
    2 x cp), for comparison with the document-aware dealing."""
    seq = document_ids.shape[1]
    work = _query_work(document_ids.to("cpu")).reshape(2 * cp, seq // (2 * cp)).sum(dim=1)
    return _imbalance([int(work[r] + work[2 * cp - 1 - r]) for r in range(cp)])


# ----------------------------------------------------------------------------- sharding


def unshard_by_plan(
    cp_mesh: DeviceMesh, tensors: list[torch.Tensor], seq_dims: list[int], plan: DocumentRing
) -> list[torch.Tensor]:
    """Each rank's share put back in sequence order along its sequence dimension."""
    inverse = torch.argsort(plan.order)
    gathered = gather_sequence_pieces(cp_mesh, tensors, seq_dims)
    return [t.index_select(d, inverse.to(t.device)) for t, d in zip(gathered, seq_dims)]


# ----------------------------------------------------------------------------- the scope


class _Scope:
    plan: DocumentRing | None = None


_SCOPE = _Scope()


@contextlib.contextmanager
def document_ring_scope(plan: DocumentRing) -> Iterator[None]:
    """Within it, every layer `apply_document_ring_cp` wrapped runs the ring of `plan`."""
    before = _SCOPE.plan
    _SCOPE.plan = plan
    try:
        yield
    finally:
        _SCOPE.plan = before


def apply_document_ring_cp(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Wrap the `attend` of every attention layer of `model` for ring context parallel over
    packed documents on `cp_mesh` (after tensor parallel, before compile); returns how many."""
    layers = [m for m in model.modules() if isinstance(m, HeadAttention)]
    for layer in layers:
        layer.attend = _over_documents(layer.attend, cp_mesh)  # type: ignore[method-assign]
    return len(layers)


def _over_documents(attend: Callable, cp_mesh: DeviceMesh) -> Callable:
    def attend_ring(q, k, v, mask):
        plan = _SCOPE.plan
        if plan is None:
            return attend(q, k, v, mask)
        # The rows this layer is given (a pipeline's microbatch) bring their own ids in the
        # model's mask; without one they are the whole batch the plan was made for.
        if isinstance(mask, DocumentMask) and mask.document_ids is not None:
            plan = plan.for_rows(mask.document_ids)
        return ring_document_attention(q, k, v, plan, cp_mesh.get_group())

    return attend_ring


# ----------------------------------------------------------------------------- the ring


# Compiled blocks run the ring eagerly (a graph break around it): its plan is host data read
# per batch, and its exchanges are point-to-point sends the compiler does not trace.
@torch.compiler.disable
def ring_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DocumentRing, group
) -> torch.Tensor:
    """Block-causal attention of this rank's share `q` `[batch, heads, local, head_dim]` over
    every rank's keys and values (`k`, `v` with the same or fewer heads), by `plan`."""
    return _RingAttention.apply(q, k, v, plan, group)


def _neighbours(group, cp: int, rank: int) -> tuple[int, int]:
    return (
        dist.get_global_rank(group, (rank + 1) % cp),
        dist.get_global_rank(group, (rank - 1) % cp),
    )


def _pass_on(t: torch.Tensor, group, cp: int, rank: int):
    """Send `t` to the next rank and receive the previous rank's into a new tensor; returns
    (received, requests) for `_wait`."""
    after, before = _neighbours(group, cp, rank)
    got = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, after, group), dist.P2POp(dist.irecv, got, before, group)]
    return got, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for r in requests:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: DocumentRing, group):
        cp, rank = plan.cp, plan.rank
        scale = 1.0 / math.sqrt(q.shape[-1])
        held = torch.cat([k, v], dim=1).contiguous()  # one message per hop
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(cp):
            source = (rank - step) % cp
            # The next hop travels while this one's blocks are computed.
            pending = _pass_on(held, group, cp, rank) if step < cp - 1 else None
            hk, hv = held.split([k.shape[1], v.shape[1]], dim=1)
            for rows, keys, mask in _blocks(plan, source, q.device):
                o, s = _pair_forward(
                    q[:, :, rows],
                    _repeat(hk[:, :, keys], q),
                    _repeat(hv[:, :, keys], q),
                    mask,
                    scale,
                )
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o, s)
            if pending is not None:
                held, requests = pending
                _wait(requests)
        out = out.to(q.dtype)  # what the backward reads, and what the layer returns
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, group, scale = ctx.plan, ctx.group, ctx.scale
        cp, rank = plan.cp, plan.rank
        grad_out = grad_out.contiguous()
        out_q = out
        dq = torch.zeros_like(q, dtype=torch.float32)
        heads_k = k.shape[1]
        held = torch.cat([k, v], dim=1).contiguous()
        grads = torch.zeros_like(held, dtype=torch.float32)
        for step in range(cp):
            source = (rank - step) % cp
            hk, hv = held.split([heads_k, heads_k], dim=1)
            for rows, keys, mask in _blocks(plan, source, q.device):
                dq_b, dk_b, dv_b = _pair_backward(
                    grad_out[:, :, rows],
                    q[:, :, rows],
                    _repeat(hk[:, :, keys], q),
                    _repeat(hv[:, :, keys], q),
                    out_q[:, :, rows],
                    lse[:, :, rows],
                    mask,
                    scale,
                )
                dq[:, :, rows] += dq_b
                grads[:, :heads_k, keys] += _fold(dk_b, heads_k)
                grads[:, heads_k:, keys] += _fold(dv_b, heads_k)
            # The keys go on to the next rank, their gradients with them; after cp hops the
            # gradients of my own keys are back.
            message = torch.cat([held.float(), grads], dim=1) if step < cp - 1 else grads
            got, requests = _pass_on(message.contiguous(), group, cp, rank)
            _wait(requests)
            if step < cp - 1:
                held, grads = got[:, : 2 * heads_k].to(q.dtype), got[:, 2 * heads_k :]
            else:
                grads = got
        dk, dv = grads.split([heads_k, heads_k], dim=1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _blocks(plan: DocumentRing, source: int, device: torch.device):
    """(my query rows, the key rows of `source`'s share they see, their mask or None) for each
    of my chunks that sees any of `source`'s chunks; masks are made once per batch."""
    size, mine, theirs = plan.size, plan.owned[plan.rank], plan.owned[source]
    for a, seen in plan.pair_blocks(source):
        rows = slice(a * size, (a + 1) * size)
        keys = torch.cat([torch.arange(b * size, (b + 1) * size) for b in seen]).to(device)
        if len(seen) == seen[-1] - seen[0] + 1:  # neighbouring chunks: a view, not a copy
            keys = slice(seen[0] * size, (seen[-1] + 1) * size)
        cache = ("keys", mine[a], tuple(theirs[b] for b in seen), str(device))
        if cache not in plan._masks:
            masks = [plan.block_mask(mine[a], theirs[b]) for b in seen]
            if all(m is None for m in masks):
                plan._masks[cache] = None
            else:
                full = torch.ones(plan.ids.shape[0], 1, size, size, dtype=torch.bool)
                both = [full if m is None else m for m in masks]
                plan._masks[cache] = _Mask(torch.cat(both, dim=-1).to(device))
        yield rows, keys, plan._masks[cache]


class _Mask:
    """One query chunk's mask over the keys it sees, in the forms the kernels take, each made
    once per batch: bool (True: allowed), additive (0 / -inf, the CPU flash kernel's), and the
    rows with no allowed key."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self.empty_rows = ~allowed.any(dim=-1)  # [batch, 1, rows]
        self._bias: dict[torch.dtype, torch.Tensor] = {}

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._bias:
            zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self._bias[dtype] = zeros.masked_fill(~self.allowed, float("-inf"))
        return self._bias[dtype]


def _repeat(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped key/value heads repeated to the query heads, for the kernel only."""
    n = q.shape[1] // kv.shape[1]
    return kv if n == 1 else kv.repeat_interleave(n, dim=1)


def _fold(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of repeated heads summed back onto the grouped heads."""
    b, h, s, d = grad.shape
    return grad if h == heads else grad.float().reshape(b, heads, h // heads, s, d).sum(dim=2)


def _merge(out, lse, o, s):
    """Two partial softmax results merged by their log-sum-exps (float32); a row a pair left
    without any key has s = -inf and weight 0."""
    new = torch.logaddexp(lse, s)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # rows no key has reached yet
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(s - safe).unsqueeze(-1)
    return out * w_old + o.float() * w_new, new


def _pair_forward(q, k, v, mask: _Mask | None, scale):
    """(output float32, log-sum-exp `[batch, heads, local]` float32) of `q` over one share's
    keys under `mask` (None: every key); a row with no allowed key gets -inf, output 0."""
    if q.device.type == "cpu" and not _Kernel.plain:
        o, s = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        o, s = o.float(), s.float()
    else:
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask.allowed, float("-inf"))
        s = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - s.masked_fill(s == float("-inf"), 0.0).unsqueeze(-1))
        o = p @ v.float()
    if mask is not None:
        s = s.masked_fill(mask.empty_rows, float("-inf"))
        o = o.masked_fill(mask.empty_rows.unsqueeze(-1), 0.0)
    return o, s


def _pair_backward(grad_out, q, k, v, out, lse, mask, scale):
    """(dq, dk, dv) of one pair from the merged `out` and `lse` (the whole softmax's)."""
    if q.device.type == "cpu" and not _Kernel.plain:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        return dq.float(), dk, dv
    g, o = grad_out.float(), out.float()
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    p = torch.exp(scores - lse.unsqueeze(-1))
    if mask is not None:
        p = p.masked_fill(~mask.allowed, 0.0)
    dv = p.transpose(-1, -2) @ g
    dp = g @ v.float().transpose(-1, -2)
    ds = p * (dp - (g * o).sum(dim=-1, keepdim=True))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv


def _bias(mask: _Mask | None, dtype: torch.dtype) -> torch.Tensor | None:
    # The CPU flash kernel takes an additive mask in the queries' dtype, not a bool one.
    return None if mask is None else mask.bias(dtype)
