"""QK-Clip (Kimi K2, arXiv:2507.20534; with Muon, "MuonClip"): after each optimizer step, every
attention head whose largest logit in the step's forward passes exceeded `tau` has its query
and key projections scaled down so that that logit would have been `tau`.

For head h, S_h is the largest q_h . k_h x scale over the step's batches and the (query, key)
pairs its mask allows (the causal ones; within a document for a block-causal mask), and
gamma_h = min(1, tau / S_h). A logit is bilinear in the query and key projections, so scaling
head h's query rows by a and its key rows by b scales all its logits by a b:

- multi-head attention (a key per query head): a = b = sqrt(gamma_h), the paper's rule;
- multi-head latent attention (DeepSeek-V3, Kimi K2): the position-free query and key parts
  (q_C, the head's k_C rows of `wkv_b`) by sqrt(gamma_h), the rotary query q_R by gamma_h, and
  the rotary key k_R, which every head shares, not at all (the paper's rule);
- grouped-query attention (key head g shared by the query heads G_g): the key rows of g by
  sqrt(gamma_g) with gamma_g = min over G_g of gamma_h, the query rows of each h in G_g by
  gamma_h / sqrt(gamma_g). Each head's logits then scale by exactly gamma_h: an over-tau head
  lands on tau, no head's logits grow, and a head under tau keeps its logits (its query rows
  grow by 1 / sqrt(gamma_g) to make up for the shared key). With one query head per key head it
  is the MHA rule.

A head under tau has gamma_h = 1, and the rows of a group with no head over tau are multiplied
by exactly 1: nothing is read back to the host to decide what to touch.

The layers are found as `titan_core.HeadAttention` and say which rows are whose
(`qk_clip_layout`). Recording wraps each layer's `attend(q, k, v, mask)` and takes, without
gradients and in chunks of queries, the largest logit of each of the heads the rank holds.
Under tensor parallel a rank holds a contiguous share of the heads (and the weight rows of
the same heads): the per-head maxima are placed at the rank's offset, and, with those of the
data-parallel ranks, reduced by MAX, so every rank computes the same factors. A DTensor weight
(FSDP2's Shard(0) of rows, TP's colwise split, both) is scaled through a row-factor tensor
distributed like it, each rank scaling its own rows. Expert parallel does not touch attention.
Context parallel (each rank holding part of the sequence) is not supported: the trainer refuses
it with QK-Clip.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_core import HeadAttention, QKClipLayout

CHUNK_ELEMENTS = 1 << 24
"""Logits held at once while finding a layer's largest (64 MiB in float32)."""


@torch.no_grad()
def max_logits(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask=None, window: int | None = None
) -> torch.Tensor:
    """The largest logit q . k x scale of each query head, over the batch and the causal
    (query, key) pairs (within a sliding `window`), within a document when `mask` carries
    `document_ids`
    (titan_core.DocumentMask): `[heads]` in float32, from `[batch, heads, seq, head_dim]`
    queries and keys (fewer key heads: grouped-query attention)."""
    q, k = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k))
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, seq, dim).float()
    keys = k.float()
    ids = getattr(mask, "document_ids", None)
    positions = torch.arange(seq, device=q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, batch * heads * seq))
    best = torch.full((kv_heads, heads // kv_heads), -math.inf, device=q.device)
    for start in range(0, seq, chunk):
        rows = positions[start : start + chunk]
        logits = torch.einsum("bgrqd,bgkd->bgrqk", grouped[:, :, :, start : start + chunk], keys)
        allowed = (positions[None, :] <= rows[:, None])[None]  # [1, queries, keys]
        if window is not None:
            allowed = allowed & (rows[:, None] - positions[None, :] < window)[None]
        if ids is not None:
            allowed = allowed & (ids[:, start : start + chunk, None] == ids[:, None, :])
        logits = logits.masked_fill(~allowed[:, None, None], -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)) * scale)
    return best.reshape(heads)


def head_factors(gamma: torch.Tensor, kv_heads: int) -> dict[str, torch.Tensor]:
    """Each role's factor (titan_core.QKClipRole) for the per-head `gamma` of one layer: `q`,
    `q_alone` per query head, `k` per key/value head (see the module docstring)."""
    group = gamma.reshape(kv_heads, -1).amin(dim=1)
    shared = group.sqrt()
    return {
        "q": gamma / shared.repeat_interleave(gamma.numel() // kv_heads),
        "q_alone": gamma,
        "k": shared,
    }


def scale_rows_(weight: torch.Tensor, factors: torch.Tensor) -> None:
    """Multiply row i of `weight` (a matrix or a bias, a tensor or DTensor, rows split any
    way) by `factors[i]`."""
    column = factors.to(torch.float32).reshape(-1, *[1] * (weight.ndim - 1))
    if isinstance(weight, DTensor):
        column = distribute_tensor(
            column, weight.device_mesh, weight.placements, src_data_rank=None
        ).to_local()
        weight = weight.to_local()
    if weight.numel():
        weight.copy_(weight * column)


def apply_layout_(layout: QKClipLayout, gamma: torch.Tensor, kv_heads: int) -> None:
    """Scale the rows of `layout` for the per-head factors `gamma` of its layer."""
    factors = head_factors(gamma, kv_heads)
    for rows in layout.rows:
        per_head = []
        for role, n in rows.parts:
            f = factors.get(role)
            if f is None:  # "none": the values' rows
                f = torch.ones(kv_heads if rows.per == "kv" else gamma.numel(), device=gamma.device)
            per_head.append(f[:, None].expand(-1, n))
        scale_rows_(rows.weight, torch.cat(per_head, dim=1).reshape(-1))


class QKClip:
    """QK-Clip over the attention layers of `model_parts`: built after parallelize (it wraps
    each layer's `attend` to record its logits); call `clip_()` after every optimizer step.

    Args:
        model_parts: the modules (pipeline stages) this rank holds.
        tau: the largest logit allowed (the paper's 100); None records the logits and scales
            nothing (`clip_` then only reports the largest: a monitor for any optimizer).
        tp_mesh: the tensor-parallel mesh that splits the heads, if any.
        reduce_meshes: meshes whose ranks saw other data for the same weights (data parallel),
            whose maxima are reduced with this rank's.
        report_mesh: a mesh over which the reported maximum is reduced too (pipeline stages).
    """

    def __init__(
        self,
        model_parts: Iterable[nn.Module],
        tau: float | None,
        *,
        tp_mesh: DeviceMesh | None = None,
        reduce_meshes: Iterable[DeviceMesh | None] = (),
        report_mesh: DeviceMesh | None = None,
    ) -> None:
        if tau is not None and not tau > 0:
            raise ValueError(f"QK-Clip's tau must be positive (or None: record only), got {tau}")
        self.tau = None if tau is None else float(tau)
        self.tp_mesh = tp_mesh
        self.reduce_meshes = [m for m in reduce_meshes if m is not None and m.size() > 1]
        self.report_mesh = report_mesh
        self.layers: list[HeadAttention] = [
            m for part in model_parts for m in part.modules() if isinstance(m, HeadAttention)
        ]
        self._records: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            view = layer.qk_clip_layout()
            layer.attend = self._recording(i, layer.attend, view.scale, view.window)  # type: ignore[method-assign]

    def _recording(self, i: int, attend, scale: float, window: int | None):
        def attend_and_record(q, k, v, mask):
            found = max_logits(q, k, scale, mask, window)
            previous = self._records[i]
            self._records[i] = found if previous is None else torch.maximum(previous, found)
            return attend(q, k, v, mask)

        return attend_and_record

    def _gathered(self) -> torch.Tensor:
        """Every layer's per-head maxima since the last clip, whole and alike on every rank."""
        device = next(iter(self._records_or_weights())).device
        tp_rank = self.tp_mesh.get_local_rank() if self.tp_mesh is not None else 0
        vectors = []
        for layer, record in zip(self.layers, self._records):
            full = torch.full((layer.attention_heads()[0],), -math.inf, device=device)
            if record is not None:
                n = record.numel()
                full[tp_rank * n : (tp_rank + 1) * n] = record.to(device)
            vectors.append(full)
        flat = torch.cat(vectors) if vectors else torch.zeros(0, device=device)
        meshes = [self.tp_mesh] if self.tp_mesh is not None and self.tp_mesh.size() > 1 else []
        for mesh in meshes + self.reduce_meshes:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return flat

    def _records_or_weights(self):
        for record in self._records:
            if record is not None:
                yield record
        for layer in self.layers:
            yield layer.qk_clip_layout().rows[0].weight

    @torch.no_grad()
    def clip_(self) -> torch.Tensor:
        """Scale the heads whose largest logit since the last call exceeded tau (none when
        recording only) and forget the records; returns that largest logit over every layer
        (a device tensor; -inf when no attention ran)."""
        if not self.layers:
            return torch.tensor(-math.inf)
        flat = self._gathered()
        self._records = [None] * len(self.layers)
        if self.tau is not None:
            self._scale_(flat)
        top = flat.max() if flat.numel() else flat.new_tensor(-math.inf)
        if self.report_mesh is not None and self.report_mesh.size() > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.report_mesh.get_group())
        return top

    def _scale_(self, flat: torch.Tensor) -> None:
        gamma = torch.where(flat > self.tau, self.tau / flat, torch.ones_like(flat))
        start = 0
        for layer in self.layers:
            heads, kv_heads = layer.attention_heads()
            apply_layout_(layer.qk_clip_layout(), gamma[start : start + heads], kv_heads)
            start += heads
