"""Converts Llama state dicts between our names and Hugging Face's `LlamaForCausalLM` (through
`titan_models.hf_adapter`, which documents the conversion and its limits).

Besides renaming, the query and key projections are permuted: Meta's rotary embedding rotates
interleaved pairs (0, 1), (2, 3), ... of each head, Hugging Face's rotates the halves
(0, d/2), (1, d/2 + 1), .... Reordering the output rows of wq/wk per head makes the two
models compute the same function; `from_hf` applies the exact inverse reordering. A shard
of ours that cuts a head in two (FSDP splits rows anywhere) maps to two runs of rows of
theirs, one per position in the pairs; one that covers whole heads, to the same heads.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_core.protocols import HFSlice
from titan_models.hf_adapter import (
    NORM_NAMES,
    DecoderHFAdapter,
    Transform,
    attention_names,
    gqa_config,
    swiglu_names,
)


def _interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _half_split_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Permuted(Transform):
    """A q or k projection of `heads` heads, its output rows reordered per head."""

    def __init__(self, ours: str, theirs: str, heads: int):
        self.ours, self.theirs, self.heads = (ours,), theirs, heads

    def to_hf(self, parts, where):
        return {self.theirs: _interleaved_to_half_split(parts[self.ours[0]], self.heads)}

    def from_hf(self, parts, where):
        return {self.ours[0]: _half_split_to_interleaved(parts[self.theirs], self.heads)}

    def to_hf_slices(self, name, shape, index, tensor, where):
        rows, cols = index
        size = shape[0] // self.heads
        out = []
        start = rows.start
        while start < rows.stop:
            head = start // size
            whole = (rows.stop - start) // size if start % size == 0 else 0
            if whole:  # whole heads map to the same heads, their rows reordered
                stop = start + whole * size
                piece = tensor[start - rows.start : stop - rows.start]
                hf = HFSlice(self.theirs, shape, (slice(start, stop), cols))
                out.append((hf, _interleaved_to_half_split(piece, whole)))
                start = stop
                continue
            # Part of a head: our row head*size + 2i + p is their row head*size + p*size/2 + i.
            stop = min(rows.stop, (head + 1) * size)
            first, last = start - head * size, stop - head * size
            for p in (0, 1):
                i0, i1 = (first - p + 1) // 2, (last - p + 1) // 2
                if i1 > i0:
                    ours_first = head * size + 2 * i0 + p - rows.start
                    piece = tensor[ours_first : ours_first + 2 * (i1 - i0) - 1 : 2]
                    base = head * size + p * size // 2
                    out.append(
                        (HFSlice(self.theirs, shape, (slice(base + i0, base + i1), cols)), piece)
                    )
            start = stop
        return out

    def from_hf_slice(self, name, shape, index, read, where):
        rows, cols = index
        size = shape[0] // self.heads
        first, last = rows.start // size, -(-rows.stop // size)  # the heads the rows are in
        heads = read(HFSlice(self.theirs, shape, (slice(first * size, last * size), cols)))
        ours = _half_split_to_interleaved(heads, last - first)
        return ours[rows.start - first * size : rows.stop - first * size]


def llama3_rope_scaling(args: Any) -> dict[str, Any]:
    """Llama 3.1's frequency scaling (`LlamaArgs.use_rope_scaling`), as Hugging Face writes it."""
    return {
        "rope_type": "llama3",
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


class LlamaHFAdapter(DecoderHFAdapter):
    """Satisfies `titan_core.protocols.HFAdapter` for `LlamaArgs` models."""

    layer_names = attention_names() | swiglu_names("feed_forward", "mlp") | NORM_NAMES

    def transforms(self) -> list[Transform]:
        q, k = "attention.wq.weight", "attention.wk.weight"
        return [
            Permuted(q, self.layer_names[q], self.args.n_heads),
            Permuted(k, self.layer_names[k], self.args.kv_heads),
        ]

    def architecture_config(self) -> dict[str, Any]:
        a = self.args
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "intermediate_size": a.ffn_hidden_dim,
            **gqa_config(a),
            "rope_theta": a.rope_theta,
            "rope_scaling": llama3_rope_scaling(a) if a.use_rope_scaling else None,
            "mlp_bias": False,
        }
