"""Multi-token prediction (MTP), as in DeepSeek-V3 (arXiv:2412.19437, section 2.2): during
training, D sequential modules predict the tokens 2, 3, ..., D + 1 positions ahead, each
keeping the full causal chain; they are dropped for inference.

With h_i the main model's last hidden state at position i and t_j the input tokens, depth
k = 1..D computes (the shared decoder runs it; `Decoder.head`):

    h^0_i = norm(h_i)                             what the main output head reads
    x^k_i = eh_proj_k([enorm_k(Emb(t_{i+k})) ; hnorm_k(h^(k-1)_i)])
    h^k_i = norm_k(Block_k(x^k_i))                one decoder block, causal over i
    logits^k_i = Output(h^k_i)                    predicts t_{i+k+1}

`Emb` and `Output` are the model's own token embedding and output projection (shared, not
copied). The embedding comes first in the concatenation, as in DeepSeek's released weights
(`eh_proj` of `model.layers.61` in the Hub checkpoint) and in Megatron-LM; the paper's formula
writes the hidden state first. h^0 is the final-normed hidden state and each depth passes its
own normed output on, as Megatron-LM and the inference engines that serve DeepSeek's MTP
weights do (the paper calls h^0 "the representation given by the main model").

Where the layers live: `MTPLayer`s are entries of the decoder's `layers`, after the main
blocks (keys n_layers .. n_layers + D - 1, as Hugging Face numbers them), so that FSDP,
activation checkpointing, compile, tensor and expert parallel treat each as the block it is.
They are the decoder's `head_layers`: its forward runs them after the final norm, and
pipeline parallel keeps them on the last stage with the output projection.

Tokens ahead: position i of depth k embeds t_{i+k}. Within one sample of length S that token
exists for i < S - k; the positions beyond get token 0 (`tokens_ahead`), and their
predictions are not trained (their labels, t_{i+k+1}, are past the sample: the trainer
ignores them). Under pipeline parallel the first stage embeds the tokens ahead (it holds the
embedding) and the stages pass the embeddings on with the hidden states, stacked as
`[1 + D, batch, seq, dim]`, to the last stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_core.init import ParamInit
from titan_core.protocols import TPStyle
from titan_models.decoder_block import DecoderBlock

MTP_TP_PLAN: dict[str, TPStyle] = {
    "enorm": "sequence_parallel",
    "hnorm": "sequence_parallel",
    "eh_proj": "per_token",  # replicated; its output is the block's residual stream
    "norm": "sequence_parallel",
}
"""An MTP layer's own modules under tensor parallel (its block is split like any other)."""


class MTPLayer(DecoderBlock):
    """One depth: `enorm` (the embedding of the token ahead), `hnorm` (the previous depth's
    hidden state), `eh_proj` (their concatenation, 2 x dim -> dim), the decoder block, and
    `norm` before the shared output projection (Hugging Face's `shared_head.norm`)."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module):
        super().__init__(dim, norm_eps, attention, feed_forward)
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(
        self, h: torch.Tensor, ahead: torch.Tensor, *tables: torch.Tensor, **attention_inputs
    ) -> torch.Tensor:
        """`h`: the previous depth's normed hidden states; `ahead`: the embeddings of the
        tokens this depth reads (t_{i+k} at position i). Returns this depth's normed hidden
        states, which the output projection and the next depth read."""
        x = self.eh_proj(torch.cat([self.enorm(ahead), self.hnorm(h)], dim=-1))
        return self.norm(super().forward(x, *tables, **attention_inputs))


def mtp_init_plan(std: float) -> dict[str, ParamInit]:
    """How an MTP layer's own parameters start, by name relative to the layer (its block's
    come from the block's plan): norms at 1, `eh_proj` with `std` (it reads its input)."""
    plan = {f"{n}.weight": ParamInit("constant", value=1.0) for n in ("enorm", "hnorm", "norm")}
    return plan | {"eh_proj.weight": ParamInit.truncated(std)}


def tokens_ahead(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """`[depth * batch, seq]`: for k = 1..depth, `tokens` moved k positions left, token 0
    where the sample ends (the rows of depth 1 first)."""
    seq = tokens.shape[1]
    return torch.cat(
        [F.pad(tokens[:, min(k, seq) :], (0, min(k, seq))) for k in range(1, depth + 1)]
    )
