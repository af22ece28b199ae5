"""All-to-all context parallel: each rank attends over the whole sequence with a share of the
heads (the scheme of DeepSpeed-Ulysses, arXiv:2309.14509).

The sequence is cut into `cp` contiguous pieces, one per rank, as for the ring; everything
outside attention runs on a rank's own piece. Around attention, an all-to-all trades pieces of
the sequence for whole heads: a rank sends each other rank its positions of that rank's heads
and receives, for its own heads, every position. Attention then runs as in one process, with
whatever mask the model built for the whole sequence (causal, block-causal over packed
documents, Llama 4's chunks) and on any kernel; a second all-to-all gives each rank its
positions of every head back. The cost is four all-to-alls of one activation per layer
(queries, keys, values, output; grouped key/value heads travel once per group), none of them
growing with the CP degree the way a ring's steps do, and no load balancing: every rank
attends over the same positions.

The layers are found by what they are (`titan_core.HeadAttention`): `apply_alltoall_cp` wraps
each one's `attend`, and the wrapper trades heads for positions only inside `alltoall_scope`
(what `cp_context(style="alltoall")` opens), so that the model runs unchanged elsewhere. Query
heads (after tensor parallel) must divide by the CP degree; key/value heads that do not are
repeated, to the fewest copies that divide, before the trade.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_core import ConfigError, HeadAttention

__all__ = [
    "alltoall_heads_problems",
    "alltoall_scope",
    "apply_alltoall_cp",
    "head_attention_layers",
    "kv_repeats",
]


class _Scope:
    """Whether the wrapped layers trade heads for positions now (one flag for the process:
    `torch.compile` guards on it, so a compiled block recompiles once when it flips)."""

    active = False


_SCOPE = _Scope()


@contextlib.contextmanager
def alltoall_scope() -> Iterator[None]:
    """Within it, every layer `apply_alltoall_cp` wrapped attends over the whole sequence."""
    before = _SCOPE.active
    _SCOPE.active = True
    try:
        yield
    finally:
        _SCOPE.active = before


def head_attention_layers(model: nn.Module) -> list[HeadAttention]:
    """The attention layers of `model` (`titan_core.HeadAttention`), in module order."""
    return [m for m in model.modules() if isinstance(m, HeadAttention)]


def kv_repeats(q_heads: int, kv_heads: int, cp: int) -> int:
    """How many copies of each key/value head the trade needs: the fewest that make the
    key/value heads divide by `cp` while still grouping the query heads evenly (1: none)."""
    for copies in range(1, q_heads // kv_heads + 1):
        heads = kv_heads * copies
        if heads % cp == 0 and q_heads % heads == 0:
            return copies
    raise ConfigError(f"no repetition of {kv_heads} key/value heads divides by {cp}")


def alltoall_heads_problems(model: nn.Module, tp: int, cp: int) -> list[str]:
    """Why all-to-all context parallel cannot run `model` with `tp`-way tensor parallel and
    `cp`-way context parallel (empty when it can): it needs attention layers it can find, and
    query heads per tensor-parallel rank that divide by the CP degree."""
    layers = head_attention_layers(model)
    if not layers:
        return [
            f"{type(model).__name__} has no attention layer that all-to-all context parallel can"
            " find (a module that inherits titan_core.HeadAttention)\nuse"
            " context_parallel_style = 'ring', or declare the attention modules"
        ]
    problems = []
    for q_heads, _kv in sorted({layer.attention_heads() for layer in layers}):
        local = q_heads // tp
        if local % cp:
            problems.append(
                f"{local} query heads per tensor-parallel rank ({q_heads} / tensor_parallel"
                f" {tp}) do not divide by context_parallel_degree {cp}, which all-to-all context"
                " parallel gives each rank an equal share of\nuse context_parallel_style ="
                f" 'ring', or a context_parallel_degree that divides {local}"
            )
    return problems


def apply_alltoall_cp(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Wrap the `attend` of every attention layer of `model` for all-to-all context parallel
    over `cp_mesh` (after tensor parallel, before compile); returns how many layers. Check the
    model first with `alltoall_heads_problems` (as `parallelize` does): a rank whose query heads
    do not divide by the degree raises ConfigError at its first attention."""
    layers = head_attention_layers(model)
    cp = cp_mesh.size()
    for layer in layers:
        layer.attend = _over_whole_sequence(layer.attend, cp_mesh, cp)  # type: ignore[method-assign]
    return len(layers)


def _over_whole_sequence(attend: Callable, cp_mesh: DeviceMesh, cp: int) -> Callable:
    def attend_whole(q, k, v, mask):
        if not _SCOPE.active:
            return attend(q, k, v, mask)
        heads, kv = q.shape[1], k.shape[1]
        if heads % cp:
            raise ConfigError(
                f"all-to-all context parallel got {heads} query heads on this rank, which do not"
                f" divide by context_parallel_degree {cp}\nuse context_parallel_style = 'ring'"
            )
        copies = kv_repeats(heads, kv, cp) if kv % cp else 1
        if copies > 1:  # each group's queries still read the same key/value head
            k, v = (t.repeat_interleave(copies, dim=1) for t in (k, v))
        q, k, v = (_gather_sequence(t, cp_mesh, cp) for t in (q, k, v))
        return _scatter_sequence(attend(q, k, v, mask), cp_mesh, cp)

    return attend_whole


def _all_to_all(x: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """Chunk i of dim 0 to rank i; chunk i of the result came from rank i (autograd: the
    backward is the same trade the other way)."""
    return _waited(funcol.all_to_all_single_autograd(x, None, None, cp_mesh))


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, cp: int) -> torch.Tensor:
    """[batch, heads, seq/cp, d] (every head, my positions) -> [batch, heads/cp, seq, d] (my
    heads, every position, in rank order)."""
    b, h, s, d = x.shape
    pieces = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = _all_to_all(pieces, cp_mesh)  # [cp: positions of rank i, b, h/cp, s, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _scatter_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, cp: int) -> torch.Tensor:
    """The inverse of `_gather_sequence`: [batch, heads/cp, seq, d] -> [batch, heads, seq/cp, d]."""
    b, h, s, d = x.shape
    pieces = x.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = _all_to_all(pieces, cp_mesh)  # [cp: heads of rank i, b, h, s/cp, d]
    return got.transpose(0, 1).reshape(b, cp * h, s // cp, d)


def keep_positions_(
    buffers: list[torch.Tensor], seq_dims: list[int], positions: torch.Tensor
) -> list[torch.Tensor]:
    """Cut each buffer in place to `positions` (in that order) along its sequence dimension;
    returns full copies to restore from (`restore_`)."""
    full = []
    for buffer, dim in zip(buffers, seq_dims):
        whole = buffer.clone()
        piece = whole.index_select(dim, positions.to(whole.device)).contiguous()
        buffer.resize_(piece.shape)
        buffer.copy_(piece)
        full.append(whole)
    return full


def restore_(buffers: list[torch.Tensor], full: list[torch.Tensor]) -> None:
    """Give sharded buffers their whole contents back (`keep_positions_`'s copies)."""
    for buffer, whole in zip(buffers, full):
        buffer.resize_(whole.shape)
        buffer.copy_(whole)


def gather_sequence_pieces(
    cp_mesh: DeviceMesh, tensors: list[torch.Tensor], seq_dims: list[int]
) -> list[torch.Tensor]:
    """Each rank's contiguous piece put back together along its sequence dimension."""
    return [
        _waited(funcol.all_gather_tensor(t.contiguous(), gather_dim=d, group=cp_mesh))
        for t, d in zip(tensors, seq_dims)
    ]
