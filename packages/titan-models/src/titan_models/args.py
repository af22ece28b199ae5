"""What every model family's arguments share: the decoder's shape fields, their checks, and the
size of the debug flavors.

A family's args are a frozen dataclass that subclasses `DecoderArgs`, adds its own fields,
sets the shared fields' defaults to its flagship's (a field declared again without a docstring
keeps this one's), and lists what is inconsistent in `problems()`. `DecoderArgs` has every
member a trainer reads (`titan_core.ModelArgs`): the vocabulary and sequence length it sets,
the experts and the multi-token-prediction depth it asks about.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # a type only: the args of a dense family need nothing of the experts
    from titan_models.moe.args import MoEArgs


@dataclass(frozen=True)
class DecoderArgs:
    """The fields the shared decoder (`titan_models.decoder.Decoder`) reads, with Llama 3's
    defaults."""

    dim: int = 4096
    """Width of the residual stream (hidden_size)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Attention (query) heads."""
    vocab_size: int = 128256
    """Rows of the embedding table; the trainer replaces it with its tokenizer's."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""
    max_seq_len: int = 131072
    """Rows of the rotary table; the trainer sets it to training.seq_len."""
    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    depth_init: bool = True
    """Scale the residual-writing projections by each block's depth (else by n_layers)."""
    moe: MoEArgs | None = None
    """The mixture of experts of the blocks the family gives experts (`Decoder.moe_args`);
    None: every block dense."""
    n_mtp_layers: int = 0
    """Multi-token-prediction depth D (num_nextn_predict_layers): in training, D sequential
    layers after the blocks predict the tokens 2..D+1 positions ahead (`titan_models.mtp`);
    DeepSeek-V3 has 1. They are dropped for inference."""
    attention_bias: bool = False
    """The attention's four projections have biases (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned sink logit per attention head in every layer's softmax (GPT-OSS; see
    `titan_models.local_attention`)."""
    block_causal_impl: Literal["auto", "dense", "flex", "varlen"] = "auto"
    """How the block-causal mask of a forward with `document_ids` is computed (see
    `titan_models.block_causal`); the trainer's `[model] block_causal_impl`."""

    def __post_init__(self) -> None:
        if problems := self.problems():
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """What is inconsistent in these arguments (none here; each family lists its own)."""
        return []

    def attention_window(self, layer_id: int) -> int | None:
        """Block `layer_id`'s sliding attention window: a query sees this many positions, its
        own included; None (every block, unless a family says otherwise): all earlier ones."""
        return None

    def attention_windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the blocks, smallest first."""
        windows = {self.attention_window(i) for i in range(self.n_layers)}
        return tuple(sorted(w for w in windows if w is not None))


def head_problems(dim: int, n_heads: int, kv_heads: int, head_dim: int | None = None) -> list[str]:
    """What is wrong with grouped-query attention heads for rotary embeddings; `head_dim` None
    means dim // n_heads."""
    out = []
    if head_dim is None and dim % n_heads:
        out.append(f"dim {dim} is not divisible by n_heads {n_heads}")
    elif (size := dim // n_heads if head_dim is None else head_dim) % 2:
        out.append(f"head_dim {size} must be even for rotary embeddings")
    if n_heads % kv_heads:
        out.append(f"n_heads {n_heads} is not divisible by n_kv_heads {kv_heads}")
    return out


DEBUG_SIZE = dict(dim=256, n_layers=6, vocab_size=2048, max_seq_len=2048)
"""Every family's `debugmodel` flavor has this size: small enough for CPU tests, and alike
across families so that their tests and benchmarks compare like with like."""
