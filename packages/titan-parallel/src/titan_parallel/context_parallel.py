"""Context parallel: shard the sequence across ranks and run attention as ring attention.

Built on PyTorch's experimental API (`torch.distributed.tensor.experimental.context_parallel`):
inside `cp_context`, the listed buffers (input tokens, labels, the RoPE table) are cut along
their sequence dimension, each rank keeping its share, and every call to
`torch.nn.functional.scaled_dot_product_attention` exchanges key/value shards with the other
ranks of the CP mesh ("allgather": gather all K/V once; "alltoall": pass them round a ring).
With load balancing the sequence is cut into 2 x cp chunks and rank r keeps chunks r and
2cp-1-r (head and tail), so that causal attention costs every rank the same.

PyTorch only routes its CUDA attention kernels (flash, memory-efficient, cuDNN) through ring
attention. `enable_cpu_ring_attention` adds the CPU flash kernel
(`aten._scaled_dot_product_flash_attention_for_cpu` and its backward) to the same machinery,
so CP runs, and is tested, on CPU with gloo. That reaches into torch internals, so it is
pinned to the versions checked here (`SUPPORTED_TORCH`).

Model requirements: attention calls `F.scaled_dot_product_attention` through the module
attribute (the CP context patches it), with `is_causal=True` when load balancing, no
attention mask and no dropout; positional tables are passed as buffers so they are sharded
with the tokens. Packed documents (`document_ids=`) take Titan's own ring instead
(`titan_parallel.document_ring`), and `style="alltoall"` all-to-all context parallel; both
find the attention layers as `titan_core.HeadAttention`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_core.config import ConfigError
from titan_parallel.alltoall_attention import (
    alltoall_heads_problems,
    alltoall_scope,
    gather_sequence_pieces,
    keep_positions_,
    restore_,
)
from titan_parallel.document_ring import (
    document_ring_scope,
    plan_document_ring,
    unshard_by_plan,
)

__all__ = [
    "SUPPORTED_TORCH",
    "check_cp_seq_len",
    "check_cp_support",
    "cp_context",
    "cp_unshard",
    "enable_cpu_ring_attention",
    "resolve_cp_style",
]

SUPPORTED_TORCH = ((2, 11), (2, 15))
"""Oldest and newest torch (major, minor) whose context-parallel internals this module was
checked against; context parallel refuses to run outside them (see `check_cp_support`)."""

RotateMethod = Literal["allgather", "alltoall"]
CPStyle = Literal["ring", "alltoall"]
_SEQ_DIM = 2  # q, k, v are [batch, heads, seq, head_dim]
_aten = torch.ops.aten


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# Every torch-private name this module uses, as (module, attribute path). They are looked up
# once, at import, so that a torch without one of them is found before a job starts (through
# `check_cp_support`, which `Parallelism.validate` runs when context_parallel_degree > 1)
# rather than in the middle of a step; importing titan_parallel never fails because of them.
_RING = "torch.distributed.tensor.experimental._context_parallel._attention"
_PRIVATE_NAMES = (
    (_RING, "custom_ops"),
    (_RING, "_templated_ring_attention"),
    (_RING, "_templated_ring_attention_backward"),
    (_RING, "_cp_options.enable_load_balance"),
    (_RING, "_cp_options.rotate_method"),
    (_RING, "_RotateMethod.ALL_GATHER"),
    (_RING, "_RotateMethod.ALL_TO_ALL"),
    ("torch.distributed.tensor.experimental", "context_parallel"),
    ("torch.distributed.tensor.experimental._attention", "context_parallel_unshard"),
    ("torch.distributed.tensor._dispatch", "OpDispatcher.wrap"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
    ("torch.distributed.tensor._utils", "compute_global_tensor_info"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu.default"),
    ("torch.ops.aten", "_scaled_dot_product_flash_attention_for_cpu_backward.default"),
)


def _lookup(module: str, path: str) -> Any:
    obj: Any = torch.ops.aten if module == "torch.ops.aten" else importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _find_private_names() -> tuple[dict[str, Any], list[str]]:
    found, missing = {}, []
    for module, path in _PRIVATE_NAMES:
        try:
            found[f"{module}.{path}"] = _lookup(module, path)
        except Exception:  # ImportError, AttributeError, or an op torch does not register
            missing.append(f"{module}.{path}")
    return found, missing


def _support_problems() -> list[str]:
    low, high = SUPPORTED_TORCH
    supported = (
        f"titan_parallel's context parallel was checked with torch {low[0]}.{low[1]} to"
        f" {high[0]}.{high[1]}"
    )
    fix = (
        f"install torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}, or set"
        " [parallelism] context_parallel_degree = 1"
    )
    if not low <= _torch_version() <= high:
        return [
            f"{supported}, not torch {torch.__version__}: it uses torch-internal ring-attention"
            f" options (load balancing, the CPU kernel) that change between releases\n{fix}"
        ]
    if _MISSING:
        return [
            f"{supported}, but this torch {torch.__version__} lacks internals it uses:"
            f" {', '.join(_MISSING)}\n{fix}"
        ]
    return []


_FOUND, _MISSING = _find_private_names()


def check_cp_support() -> list[str]:
    """Problems that stop context parallel from running with the installed torch (a version
    outside `SUPPORTED_TORCH`, or a torch-internal name it uses that is missing); empty when
    it can run. Checked once, at import."""
    return _support_problems()


def _cp_internals() -> Any:
    """torch's private ring-attention module, after checking that we know this torch."""
    problems = _support_problems()
    if problems:
        raise RuntimeError(problems[0])
    return importlib.import_module(_RING)


# ----------------------------------------------------------------------------- CPU ring attention


def _ring_cpu_flash_forward(
    internals: Any,
    mesh: DeviceMesh,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_cpu_args(attn_mask, dropout_p)
    # Unlike the CUDA kernel, the CPU kernel returns only (output, logsumexp); the ring loop
    # passes any further outputs through, so there are none to fake.
    return internals._templated_ring_attention(
        mesh.get_group(),
        _SEQ_DIM,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_cpu_flash_backward(
    internals: Any,
    mesh: DeviceMesh,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    _check_cpu_args(attn_mask, dropout_p)
    return internals._templated_ring_attention_backward(
        mesh.get_group(),
        _SEQ_DIM,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _check_cpu_args(attn_mask: torch.Tensor | None, dropout_p: float) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            "context parallel attention takes no attention mask; use is_causal=True"
        )
    if dropout_p:
        raise NotImplementedError("context parallel attention on CPU does not support dropout")


def _cpu_sdpa_handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor handler for the CPU flash kernels: unwrap the sequence-sharded inputs, run the
    ring, and wrap the outputs as sequence-sharded DTensors again.

    torch's own handler goes through DTensor sharding propagation, which has no rule for the
    CPU kernels; every tensor here is Shard(2) on the CP mesh, so the specs are written out.
    """
    internals = _cp_internals()
    DTensorSpec = _FOUND["torch.distributed.tensor._dtensor_spec.DTensorSpec"]
    TensorMeta = _FOUND["torch.distributed.tensor._dtensor_spec.TensorMeta"]
    global_info = _FOUND["torch.distributed.tensor._utils.compute_global_tensor_info"]
    wrap = _FOUND["torch.distributed.tensor._dispatch.OpDispatcher.wrap"]

    mesh: DeviceMesh | None = None

    def local(x: object) -> object:
        nonlocal mesh
        if not isinstance(x, DTensor):
            return x
        if tuple(x.placements) != (Shard(_SEQ_DIM),):
            raise NotImplementedError(
                f"context parallel attention expects q/k/v sharded on the sequence, got {x.placements}"
            )
        mesh = x.device_mesh
        return x._local_tensor

    local_args = [local(a) for a in args]
    local_kwargs = {k: local(v) for k, v in kwargs.items()}
    if mesh is None:
        raise AssertionError("CPU ring attention handler called without DTensor inputs")
    run = (
        _ring_cpu_flash_forward
        if op_call == _aten._scaled_dot_product_flash_attention_for_cpu.default
        else _ring_cpu_flash_backward
    )
    results = run(internals, mesh, *local_args, **local_kwargs)
    placements = (Shard(_SEQ_DIM),)
    specs = []
    for res in results:
        shape, stride = global_info(res, mesh, placements)
        meta = TensorMeta(torch.Size(shape), tuple(stride), res.dtype)
        specs.append(DTensorSpec(mesh, placements, tensor_meta=meta))
    return wrap(tuple(results), tuple(specs))


def enable_cpu_ring_attention() -> None:
    """Let context parallel use the CPU flash-attention kernel (idempotent).

    Adds the CPU kernel and its backward to the table of ops torch swaps in while a context
    parallel region is active, so they are handled exactly like the CUDA kernels there and
    left alone outside it.
    """
    internals = _cp_internals()
    for op in (
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    ):
        internals.custom_ops[op] = _cpu_sdpa_handler


# ----------------------------------------------------------------------------- validation


def check_cp_seq_len(
    seq_len: int, cp_degree: int, *, tp_degree: int = 1, load_balance: bool = True
) -> None:
    """Raise a config error unless `seq_len` splits evenly for CP (and TP's sequence parallel).

    With load balancing each of the cp ranks holds 2 chunks, so seq_len must divide by
    2 x cp; without it by cp. Sequence parallel also cuts each rank's share by tp.
    """
    if cp_degree <= 1 and tp_degree <= 1:
        return
    chunks = (2 * cp_degree if load_balance else cp_degree) if cp_degree > 1 else 1
    divisor = chunks * tp_degree
    if seq_len % divisor:
        parts = []
        if cp_degree > 1:
            parts.append(
                f"2 x context_parallel_degree {cp_degree} (load-balanced chunks)"
                if load_balance
                else f"context_parallel_degree {cp_degree}"
            )
        if tp_degree > 1:
            parts.append(f"tensor_parallel_degree {tp_degree}")
        below = seq_len - seq_len % divisor
        raise ConfigError(
            f"[training] seq_len = {seq_len} must divide by {' x '.join(parts)} = {divisor}\n"
            f"use seq_len = {below or divisor} or {below + divisor}"
        )


def resolve_cp_style(style: str, model: nn.Module, tp: int, cp: int) -> CPStyle:
    """The style `[parallelism] context_parallel_style` names for `model` under `tp`-way tensor
    and `cp`-way context parallel: "auto" is all-to-all where the model's attention layers are
    found and their query heads per TP rank divide by `cp`, the ring elsewhere."""
    if style in ("ring", "alltoall"):
        return style  # type: ignore[return-value]
    return "ring" if alltoall_heads_problems(model, tp, cp) else "alltoall"


# ----------------------------------------------------------------------------- the context


@contextlib.contextmanager
def cp_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore_buffers: set[torch.Tensor] | None = None,
    *,
    rotate_method: RotateMethod = "allgather",
    load_balance: bool = True,
    style: CPStyle = "ring",
    document_ids: torch.Tensor | None = None,
) -> Iterator[None]:
    """Run the enclosed forward and backward with the sequence sharded over `cp_mesh`.

    `buffers` are cut in place along `seq_dims` (e.g. `[inputs, labels, model.freqs_cis]`
    with `[1, 1, 0]`); they all need the same full sequence length, and each must be
    contiguous with memory of its own (inputs and labels sliced from one packed window are
    views of one storage: clone them). Buffers in `no_restore_buffers` (usually the batch)
    keep their local shard afterwards; the others (model buffers) get their full contents back. Wrap forward *and* backward: the backward
    of ring attention communicates too.

    `style`: "ring" (torch's ring attention, `rotate_method` and `load_balance` as above) or
    "alltoall" (`titan_parallel.alltoall_attention`: contiguous pieces, one per rank, and the
    attention layers `apply_alltoall_cp` wrapped trade heads for the whole sequence).

    `document_ids` (`[batch, seq]`, the whole batch's; ring only): packed documents. The ring
    then is `titan_parallel.document_ring`'s (positions dealt by the documents' work, each pair
    of shares under its own document mask, empty pairs skipped) on the attention layers
    `apply_document_ring_cp` wrapped; the model gets no mask of its own.
    """
    if style not in ("ring", "alltoall"):
        raise ConfigError(
            f"[parallelism] context_parallel_style = {style!r} is not valid\n"
            "use 'ring' or 'alltoall' (or 'auto' in the config)"
        )
    if style == "alltoall":
        with _alltoall_context(cp_mesh, buffers, seq_dims, no_restore_buffers):
            yield
        return
    if rotate_method not in ("allgather", "alltoall"):
        raise ConfigError(
            f"[parallelism] context_parallel_rotate_method = {rotate_method!r} is not valid\n"
            "use 'allgather' or 'alltoall'"
        )
    _check_buffers(buffers, seq_dims, cp_mesh, load_balance=load_balance)
    if document_ids is not None:
        with _document_ring_context(cp_mesh, buffers, seq_dims, no_restore_buffers, document_ids):
            yield
        return

    internals = _cp_internals()
    context_parallel = _FOUND["torch.distributed.tensor.experimental.context_parallel"]
    # torch routes only its CUDA kernels through ring attention; the CPU kernel is added for
    # CPU meshes only, leaving every other device's dispatch exactly as torch made it.
    if cp_mesh.device_type == "cpu":
        enable_cpu_ring_attention()
    options = internals._cp_options
    saved = options.enable_load_balance, options.rotate_method
    options.enable_load_balance = load_balance
    options.rotate_method = internals._RotateMethod[
        "ALL_GATHER" if rotate_method == "allgather" else "ALL_TO_ALL"
    ]
    try:
        with context_parallel(
            cp_mesh,
            buffers=list(buffers),
            buffer_seq_dims=list(seq_dims),
            no_restore_buffers=set(no_restore_buffers or ()),
        ):
            yield
    finally:
        options.enable_load_balance, options.rotate_method = saved


@contextlib.contextmanager
def _alltoall_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore_buffers: set[torch.Tensor] | None,
) -> Iterator[None]:
    _check_buffers(buffers, seq_dims, cp_mesh, load_balance=False)
    length = buffers[0].shape[seq_dims[0]] // cp_mesh.size()
    start = cp_mesh.get_local_rank() * length
    mine = torch.arange(start, start + length)
    with _kept_positions(buffers, seq_dims, no_restore_buffers, mine), alltoall_scope():
        yield


@contextlib.contextmanager
def _document_ring_context(
    cp_mesh: DeviceMesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore_buffers: set[torch.Tensor] | None,
    document_ids: torch.Tensor,
) -> Iterator[None]:
    plan = plan_document_ring(document_ids, cp_mesh.size(), cp_mesh.get_local_rank())
    mine = plan.positions(plan.rank)
    with _kept_positions(buffers, seq_dims, no_restore_buffers, mine), document_ring_scope(plan):
        yield


@contextlib.contextmanager
def _kept_positions(
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    no_restore_buffers: set[torch.Tensor] | None,
    positions: torch.Tensor,
) -> Iterator[None]:
    """Buffers cut in place to `positions` inside; afterwards the ones not in
    `no_restore_buffers` get their whole contents back."""
    keep = {id(b) for b in no_restore_buffers or ()}
    full = keep_positions_(list(buffers), list(seq_dims), positions)
    try:
        yield
    finally:
        restored = [(b, f) for b, f in zip(buffers, full) if id(b) not in keep]
        restore_([b for b, _ in restored], [f for _, f in restored])


def _check_buffers(
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    cp_mesh: DeviceMesh,
    *,
    load_balance: bool,
) -> None:
    if len(buffers) != len(seq_dims) or not buffers:
        raise ValueError(
            "cp_context needs one sequence dimension per buffer, and at least one buffer"
        )
    _check_buffers_own_their_memory(buffers)
    lengths = {b.shape[d] for b, d in zip(buffers, seq_dims)}
    if len(lengths) != 1:
        raise ValueError(
            f"cp_context buffers have different sequence lengths {sorted(lengths)}; a positional table"
            " must be sliced to the batch's sequence length before it is sharded"
        )
    check_cp_seq_len(lengths.pop(), cp_mesh.size(), load_balance=load_balance)


def _check_buffers_own_their_memory(buffers: Sequence[torch.Tensor]) -> None:
    # Sharding resizes each buffer in place and writes its shard into the buffer's storage
    # from the start. Two views of one storage (inputs = window[:, :-1], labels =
    # window[:, 1:]) would overwrite each other, and a non-contiguous view would be written
    # in the wrong layout: both silently train on corrupted tokens, so refuse them.
    seen: dict[int, int] = {}
    for i, b in enumerate(buffers):
        if not b.is_contiguous():
            raise ValueError(
                f"cp_context buffer {i} (shape {tuple(b.shape)}) is not contiguous; it is sharded"
                " in place, so pass a contiguous copy (`t.contiguous()` or `t.clone()`)"
            )
        # The storage itself, not its address: fake tensors (the dry run) all have address 0.
        ptr = b.untyped_storage()._cdata
        if b.numel() and ptr in seen:
            raise ValueError(
                f"cp_context buffers {seen[ptr]} and {i} share one storage (views of one tensor,"
                " e.g. inputs and labels sliced from one window); sharding one in place would"
                " corrupt the other, so pass `t.clone()` of each"
            )
        seen[ptr] = i


def cp_unshard(
    cp_mesh: DeviceMesh,
    tensors: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    load_balance: bool = True,
    style: CPStyle = "ring",
    document_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Gather sequence shards (e.g. logits made under `cp_context`) back into full sequences,
    undoing the load-balancing order (the ring's, or with `document_ids` the documents'
    dealing; all-to-all's pieces are in rank order)."""
    if style == "alltoall":
        return gather_sequence_pieces(cp_mesh, list(tensors), list(seq_dims))
    if document_ids is not None:
        plan = plan_document_ring(document_ids, cp_mesh.size(), cp_mesh.get_local_rank())
        return unshard_by_plan(cp_mesh, list(tensors), list(seq_dims), plan)
    internals = _cp_internals()
    context_parallel_unshard = _FOUND[
        "torch.distributed.tensor.experimental._attention.context_parallel_unshard"
    ]
    options = internals._cp_options
    saved = options.enable_load_balance
    options.enable_load_balance = load_balance
    try:
        return context_parallel_unshard(cp_mesh, list(tensors), list(seq_dims))
    finally:
        options.enable_load_balance = saved
