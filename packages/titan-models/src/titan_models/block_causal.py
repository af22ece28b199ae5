"""Block-causal attention over packed documents, in three implementations of one mask.

A packed training sample holds several documents one after another. With plain causal
attention a token attends to the end of the previous document too; with block-causal
attention (torchtitan's `attn_mask_type = "block_causal"`) it attends only to the earlier
tokens of its own document, so each document is trained as if it were alone. Rotary
embeddings are relative, so a document's scores do not depend on where it starts either.

The caller passes `document_ids` (`[batch, seq]` int, equal ids = same document, e.g.
`document_ids(tokens, bos_id)` for documents that each start with BOS) to the model's forward;
the model builds the mask once per forward with `build_attention_mask` (shared by every layer)
and each attention layer calls `attend_block_causal(q, k, v, mask)`. `impl` picks how:

- `dense`: SDPA with a `[batch, 1, seq, seq]` boolean mask. Exact, any device, O(seq^2)
  memory per sample; the reference the others are tested against.
- `flex`: FlexAttention with a `BlockMask` built from the document ids (only the 128x128
  blocks that hold allowed pairs are computed). On CUDA `flex_attention` is compiled once per
  process (Triton kernels, forward and backward) and the mask is built by a compiled
  `create_block_mask` (where torch offers `_compile`), which never materialises seq x seq.
  On the CPU it runs eagerly and forward only: torch (2.11-2.15) has no FlexAttention backward
  there, so training with it on the CPU is refused by `check_block_causal`.
- `varlen`: the batch flattened to `[batch * seq, heads, head_dim]` and cut into documents by
  `cu_seqlens` (the offsets where each document starts, int32, then the total) and
  `max_seqlen` (the longest): on CUDA torch's variable-length flash attention
  (`torch.nn.attention.varlen.varlen_attn`, torch 2.10+; no mask at all, no padding); on
  other devices (and for float32, which flash attention does not take) a reference that
  runs causal SDPA on each document segment from the same `cu_seqlens`, so that the
  bookkeeping is tested where there is no GPU.
- `auto` (default): `flex` on CUDA, `dense` elsewhere.

Every form keeps the ids it was made from (`AttentionMask.document_ids`, titan-core's
`DocumentMask`): ring context parallel over packed documents (titan-parallel's
`document_ring`) builds each pair of chunks' mask from the ids of the rows a layer is given.

Every mask has no head dimension, so tensor parallel (heads split over ranks) needs nothing
more. `check_block_causal(device, impl)` computes one implementation as a model on `device`
does and compares it with the dense mask, forward and backward, in float32 and bfloat16: the
trainer runs it before training with block-causal attention and refuses where it fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import cache
from typing import Literal

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from titan_core.compat import accepts, note_missing
from titan_core.model_protocols import DocumentMask
from titan_models.local_attention import attend_dense, causal_band

BlockCausalImpl = Literal["auto", "dense", "flex", "varlen"]
BLOCK_CAUSAL_IMPLS: tuple[str, ...] = ("auto", "dense", "flex", "varlen")


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """`[batch, seq]` ids numbering the documents of packed `tokens`, where each document
    starts with `bos_id` (the tokens before the first BOS, a document's tail cut from the
    previous sample, get id 0)."""
    return (tokens == bos_id).cumsum(dim=-1)


@dataclass(frozen=True)
class AttentionMask(DocumentMask):
    """The block-causal mask of one batch, in the form its implementation runs (one of the
    three is set), with the document ids it was made from."""

    block_mask: object | None = None
    """FlexAttention's `BlockMask` (`flex`)."""
    dense: torch.Tensor | None = None
    """`[batch, 1, seq, seq]` bool, True where attending is allowed (`dense`)."""
    cu_seqlens: torch.Tensor | None = None
    """`[documents + 1]` int32 offsets of the documents in the flattened batch (`varlen`); a
    document cut by a row's end ends there (rows never share a document)."""
    max_seqlen: int = 0
    """The longest document's length (`varlen`)."""
    document_ids: torch.Tensor | None = None
    """The `[batch, seq]` ids the mask was made from."""
    windowed: dict[int, object] = field(default_factory=dict)
    """FlexAttention's `BlockMask` of each sliding window the model's layers use, by window
    (`flex`; see `titan_models.local_attention`)."""


def resolve_impl(impl: str, device: torch.device) -> str:
    """`auto` -> `flex` on CUDA, `dense` elsewhere; the others as they are."""
    if impl not in BLOCK_CAUSAL_IMPLS:
        raise ValueError(
            f"block-causal implementation {impl!r}; choose one of {BLOCK_CAUSAL_IMPLS}"
        )
    if impl != "auto":
        return impl
    return "flex" if torch.device(device).type == "cuda" else "dense"


def build_attention_mask(
    ids: torch.Tensor | None,
    *,
    impl: str = "auto",
    flex: bool | None = None,
    windows: tuple[int, ...] = (),
) -> AttentionMask | None:
    """The block-causal mask for `document_ids` `ids` (None: plain causal attention) in the
    form `impl` runs (see the module); `windows`: the sliding windows of the layers that
    will attend under it (FlexAttention needs a mask per window). `flex=True/False` is the
    older spelling of `impl="flex"/"dense"`."""
    if ids is None:
        return None
    if flex is not None:
        impl = "flex" if flex else "dense"
    impl = resolve_impl(impl, ids.device)
    if impl == "flex":
        windowed = {w: flex_block_mask(ids, w) for w in sorted(set(windows))}
        return AttentionMask(block_mask=flex_block_mask(ids), document_ids=ids, windowed=windowed)
    if impl == "varlen":
        cu_seqlens, max_seqlen = document_offsets(ids)
        return AttentionMask(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, document_ids=ids)
    seq = ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
    same = ids[:, :, None] == ids[:, None, :]
    return AttentionMask(dense=(same & causal)[:, None], document_ids=ids)


def same_document_and_causal(ids: torch.Tensor, window: int | None = None):
    """FlexAttention's mask function for `document_ids` `ids`: query `q` of batch row `b`
    sees key `kv` when `kv` is not later and is in the same document (and, with a `window`
    W, fewer than W positions back)."""

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (ids[b, q] == ids[b, kv])

    if window is None:
        return mask_mod

    def windowed_mod(b, h, q, kv):
        return mask_mod(b, h, q, kv) & (q - kv < window)

    return windowed_mod


@functools.cache
@torch.compiler.disable  # made once per shape, outside any compiled graph
def causal_block_mask(seq: int, window: int | None, device: torch.device):
    """FlexAttention's `BlockMask` of causal attention (within a sliding `window`) over `seq`
    positions, the same for every row and head: what a layer with a window or sinks runs on
    CUDA without document ids. Made from the positions the attention sees (the whole sequence
    under tensor or context parallel), once per (seq, window, device)."""

    def mask_mod(b, h, q, kv):
        allowed = q >= kv
        return allowed if window is None else allowed & (q - kv < window)

    kwargs = (
        {"_compile": True}
        if device.type == "cuda" and accepts(create_block_mask, "_compile")
        else {}
    )
    return create_block_mask(mask_mod, None, None, seq, seq, device=device, **kwargs)


def flex_block_mask(ids: torch.Tensor, window: int | None = None):
    """FlexAttention's `BlockMask` for `ids` (and a sliding `window`): one per batch row
    (B = batch, documents differ between rows), shared by every head (H = None), on the
    device of `ids`."""
    batch, seq = ids.shape
    kwargs = {}
    # Compiled on CUDA: the eager build evaluates the mask function on every (q, kv) pair at
    # once, batch x seq^2 booleans (GBs at seq 8192); compiling it on the CPU costs minutes.
    if ids.device.type == "cuda" and accepts(create_block_mask, "_compile"):
        kwargs["_compile"] = True
    mask_mod = same_document_and_causal(ids, window)
    return create_block_mask(mask_mod, batch, None, seq, seq, device=ids.device, **kwargs)


def document_offsets(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(`cu_seqlens`, `max_seqlen`) of the documents of `ids` in the batch flattened row after
    row: a document starts where a row starts or its id changes. One host sync per batch (the
    count of documents and the longest), not per layer. On fake tensors (a memory estimate,
    whose ids cannot be read): one document per row."""
    if is_fake(ids) or ids.device.type == "meta":
        batch, seq = ids.shape
        rows = torch.arange(0, batch * seq + 1, seq, device=ids.device, dtype=torch.int32)
        return rows, seq
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()
    total = torch.tensor([ids.numel()], device=ids.device, dtype=offsets.dtype)
    cu_seqlens = torch.cat([offsets, total]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max().item())


@cache
def _flex_attention(device_type: str):
    if device_type != "cuda":  # CPU: forward only, and compiling it costs minutes there
        return flex_attention
    # Compiled once per process: eager FlexAttention materialises the scores and is slow.
    return torch.compile(flex_attention, dynamic=False)


try:  # torch 2.10+
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:
    _varlen_attn = None
# Its keywords changed between releases (looked up once here, not in every traced forward):
# 2.10 takes `is_causal`, later ones `window_size=(-1, 0)`; `enable_gqa` came later still.
_VARLEN_CAUSAL = (
    {"window_size": (-1, 0)} if accepts(_varlen_attn, "window_size") else {"is_causal": True}
)
_VARLEN_GQA = accepts(_varlen_attn, "enable_gqa")
_VARLEN_WINDOW = accepts(_varlen_attn, "window_size")


def varlen_attention_available() -> bool:
    """Whether this torch has `torch.nn.attention.varlen.varlen_attn` (torch 2.10+)."""
    return _varlen_attn is not None


def attend_block_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-causal attention of `[batch, heads, seq, head_dim]` queries, keys and values
    under `mask`; keys and values may have fewer heads (grouped-query attention, read in
    place by every kernel). `window` and `sinks`: a sliding window and the heads' sinks
    (`titan_models.local_attention`)."""
    gqa = k.shape[1] != q.shape[1]
    if mask.block_mask is not None:
        return _attend_flex(q, k, v, mask, window, sinks)
    if mask.cu_seqlens is not None:
        batch, heads, seq, head_dim = q.shape
        flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim) for t in (q, k, v)]
        if _varlen_kernel_takes(q, window, sinks):
            out = _varlen_cuda(*flat, mask.cu_seqlens, mask.max_seqlen, window)
        else:
            out = _varlen_by_segment(*flat, mask.cu_seqlens, window, sinks)
        return out.reshape(batch, seq, heads, head_dim).transpose(1, 2)
    allowed = mask.dense
    if window is not None:
        allowed = allowed & causal_band(q.shape[2], window, q.device)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    return attend_dense(q, k, v, allowed, sinks)


def _attend_flex(q, k, v, mask: AttentionMask, window: int | None, sinks) -> torch.Tensor:
    if window is None:
        block_mask = mask.block_mask
    elif window in mask.windowed:
        block_mask = mask.windowed[window]
    else:
        raise ValueError(
            f"this FlexAttention mask was built for the windows {sorted(mask.windowed)}, and a"
            f" layer attends with window {window}\nbuild it with build_attention_mask(ids,"
            f" windows=...) naming every window the model's layers use"
        )
    return attend_flex(q, k, v, block_mask, sinks)


def attend_flex(q, k, v, block_mask, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """FlexAttention of `[batch, heads, seq, head_dim]` tensors under `block_mask`, with the
    heads' `sinks` (from the log-sum-exp it returns; see `titan_models.local_attention`)."""
    gqa = k.shape[1] != q.shape[1]
    flex = _flex_attention(q.device.type)
    if sinks is None:
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    out, aux = flex(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    # softmax over the keys and the sink = softmax over the keys x Z / (Z + exp(sink))
    kept = torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1))
    return (out * kept.unsqueeze(-1)).type_as(out)


def _varlen_kernel_takes(q: torch.Tensor, window: int | None, sinks) -> bool:
    """Whether torch's variable-length flash attention runs this: on CUDA in its dtypes,
    without sinks, and with a window only where it takes `window_size`."""
    if q.device.type != "cuda" or q.dtype not in _FLASH_DTYPES:
        return False
    if sinks is not None:
        note_missing(
            "variable-length attention with sinks",
            "attention sinks under block_causal_impl = 'varlen' run SDPA per document; 'flex'"
            " runs them in one kernel",
        )
        return False
    return window is None or _VARLEN_WINDOW


# The dtypes torch's flash-attention kernels (varlen's) take; float32 takes the SDPA path.
_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def _varlen_cuda(
    q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None = None
) -> torch.Tensor:
    """torch's variable-length flash attention on `[tokens, heads, head_dim]`, causal within
    each document (and within a sliding `window`: W - 1 keys before the query); without
    `enable_gqa` the kv heads are repeated (the same result, more memory)."""
    kwargs = dict(_VARLEN_CAUSAL) if window is None else {"window_size": (window - 1, 0)}
    if k.shape[1] != q.shape[1]:
        if _VARLEN_GQA:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)


@torch.compiler.disable  # a loop over this batch's documents: one graph per batch otherwise
def _varlen_by_segment(
    q, k, v, cu_seqlens: torch.Tensor, window: int | None = None, sinks=None
) -> torch.Tensor:
    """The variable-length path on devices without a varlen kernel (and in float32 on CUDA):
    causal SDPA on each document segment `cu_seqlens` cuts from the flattened
    `[tokens, heads, head_dim]` (within a sliding `window`, with the heads' `sinks`)."""
    if q.device.type == "cuda" and q.dtype not in _FLASH_DTYPES:
        note_missing(
            f"{q.dtype} variable-length flash attention",
            "varlen attention in this dtype runs SDPA per document (flash attention takes"
            " bfloat16 and float16 only)",
        )
    lengths = cu_seqlens.diff().tolist()
    gqa = k.shape[1] != q.shape[1]
    pieces = []
    for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):
        qs, ks, vs = (t.transpose(0, 1) for t in (qs, ks, vs))  # [heads, length, head_dim]
        if window is None and sinks is None:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            allowed = causal_band(qs.shape[1], window, qs.device)
            out = attend_dense(qs[None], ks[None], vs[None], allowed, sinks)[0]
        pieces.append(out.transpose(0, 1))
    return torch.cat(pieces)


# The check's batch: two rows with different document boundaries (the mask is per row), the
# first starting inside a document and holding a one-token document, the second one document
# over the whole row; 300 positions (two blocks of 128 and a ragged third).
_CHECK_DOCUMENTS = ((5, 40, 1, 99, 60, 95), (300,))
_CHECK_HEADS, _CHECK_KV_HEADS, _CHECK_HEAD_DIM = 4, 2, 16
# Largest error allowed, as a fraction of the reference's largest value: float32 kernels sum
# in other orders (and a GPU may use TF32, ~1e-3 relative); bfloat16 keeps 8 bits (2^-8 =
# 4e-3 per rounding, a few roundings deep). A mask that lets one document see another moves
# the result by a good fraction of its scale (the CPU test measures it).
CHECK_TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def _check_ids(device: torch.device) -> torch.Tensor:
    rows = [
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in _CHECK_DOCUMENTS
    ]
    return torch.stack(rows).to(device)


def check_block_causal(
    device: torch.device,
    impl: str = "auto",
    *,
    flex: bool | None = None,
    backward: bool = True,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> list[str]:
    """Block-causal attention as a model on `device` computes it with `impl`
    (`build_attention_mask` and `attend_block_causal`), against SDPA with the dense mask in
    float32 on the same device, forward and (unless `backward=False`) backward, in float32 and
    bfloat16 (or `dtypes`). One line per disagreement, or one naming what this device and
    torch lack; empty when it agrees. `flex=True/False` is the older spelling of
    `impl="flex"/"dense"`."""
    device = torch.device(device)
    if flex is not None:
        impl = "flex" if flex else "dense"
    impl = resolve_impl(impl, device)
    if impl == "flex" and backward and device.type != "cuda":
        return [
            f"FlexAttention has no backward on {device.type} in torch {torch.__version__}, so"
            " training cannot use it there; use block_causal_impl = 'dense' or 'varlen'"
        ]
    if impl == "varlen" and device.type == "cuda" and not varlen_attention_available():
        return [
            f"torch {torch.__version__} has no torch.nn.attention.varlen (variable-length"
            " attention came in torch 2.10); use block_causal_impl = 'flex', or a newer torch"
        ]
    ids = _check_ids(device)
    batch, seq = ids.shape
    g = torch.Generator().manual_seed(0)  # drawn on the CPU: the same numbers on any device
    shapes = {"q": _CHECK_HEADS, "k": _CHECK_KV_HEADS, "v": _CHECK_KV_HEADS, "out": _CHECK_HEADS}
    drawn = {n: torch.randn(batch, h, seq, _CHECK_HEAD_DIM, generator=g) for n, h in shapes.items()}
    problems = []
    mask = build_attention_mask(ids, impl=impl)
    dense = build_attention_mask(ids, impl="dense")
    for dtype in dtypes or tuple(CHECK_TOLERANCE):
        tolerance = CHECK_TOLERANCE[dtype]
        inputs = {n: drawn[n].to(device, dtype, copy=True).requires_grad_(backward) for n in "qkv"}
        ref_inputs = {n: t.detach().float().requires_grad_(backward) for n, t in inputs.items()}
        with torch.set_grad_enabled(backward):
            out = attend_block_causal(*inputs.values(), mask)
            ref = attend_block_causal(*ref_inputs.values(), dense)
        results = {"forward": (out, ref)}
        if backward:
            weights = drawn["out"].to(device)
            (out.float() * weights).sum().backward()
            (ref * weights).sum().backward()
            for n in "qkv":
                results[f"d{n}"] = (inputs[n].grad, ref_inputs[n].grad)
        for what, (got, want) in results.items():
            error = (got.float() - want).abs().max().item()
            scale = want.abs().max().item()
            if not error <= tolerance * scale:  # also catches NaN
                problems.append(
                    f"{impl} {dtype} {what}: greatest difference {error:.3g} against the dense"
                    f" mask's result (largest value {scale:.3g}; allowed {tolerance:g} of it)"
                )
    return problems
