"""Autoregressive generation with a key/value cache, for any model whose forward takes
`kv_cache=` (Titan's Llama does).

    cache = KVCache(max_len=prompt_len + new_tokens)
    logits = model(prompt, kv_cache=cache)        # prefill: every prompt position at once
    logits = model(next_token, kv_cache=cache)     # then one position per call

The cache holds, per attention layer, the keys and values of every position so far; a layer's
tensors are allocated on first use with the shape its projections give, so a tensor-parallel
model caches only its own heads. `generate` samples greedily or with temperature, top-k and
top-p (nucleus) filtering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class LayerCache:
    """Keys and values of one attention layer, `[batch, max_len, heads, head_dim]` each."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(
        self, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `k`, `v` (`[batch, seq, heads, head_dim]`) at positions start..start+seq and
        return the keys and values of positions 0..start+seq."""
        end = start + k.shape[1]
        if self.k is None:  # values may be narrower than keys (DeepSeek's MLA)
            self.k = k.new_zeros((k.shape[0], self.max_len, *k.shape[2:]))
            self.v = v.new_zeros((v.shape[0], self.max_len, *v.shape[2:]))
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        return self.k[:, :end], self.v[:, :end]


class KVCache:
    """The cache of every layer of one model, and how many positions it holds (`pos`).

    The model reads `pos` as the position of the first token it is given, and advances it
    after each forward."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.pos = 0
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self.max_len)
        return self.layers[name]

    def check_room(self, seq_len: int) -> None:
        if self.pos + seq_len > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} positions; {self.pos} are used and "
                f"{seq_len} more were given"
            )


def causal_mask(start: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Which cached positions each of `seq_len` new queries (at start..start+seq_len-1) may
    attend to, as a boolean `[seq_len, start + seq_len]` mask; None for a single query (it
    sees everything cached)."""
    if seq_len == 1:
        return None
    return torch.ones(seq_len, start + seq_len, dtype=torch.bool, device=device).tril(start)


@dataclass
class Sampling:
    temperature: float = 0.0
    """0: greedy (the most likely token); above 0: sample from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample only among the k most likely tokens."""
    top_p: float | None = None
    """Sample only among the most likely tokens whose probabilities add up to p (nucleus)."""

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: use 0 (greedy) or more")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k = {self.top_k}: use 1 or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: use a value in (0, 1]")


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of `logits` `[batch, vocab]` (float32 math)."""
    logits = logits.float()
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the ones more likely than it already reach top_p (the most likely
        # token always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    *,
    stop_tokens: set[int] | frozenset[int] = frozenset(),
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue `prompt` (`[batch, seq]` int64) by up to `max_new_tokens` tokens with a KV
    cache; returns the new tokens `[batch, n]`. A row stops at its first token in
    `stop_tokens` (the others then get that token again); generation ends when every row has
    stopped. `vocab_limit` keeps padded vocabulary rows (ids at or above it) from being drawn.

    Under tensor parallel every rank must draw the same tokens: give each the same
    `generator` seed (greedy needs none)."""
    sampling = sampling or Sampling()
    sampling.validate()
    batch, seq = prompt.shape
    cache = KVCache(seq + max_new_tokens)
    logits = model(prompt, kv_cache=cache)[:, -1]
    out = []
    done = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
    for i in range(max_new_tokens):
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")
        token = next_token(logits, sampling, generator)
        if stop_tokens:
            previous = out[-1] if out else token
            token = torch.where(done, previous, token)
            done |= torch.isin(token, torch.tensor(sorted(stop_tokens), device=token.device))
        out.append(token)
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        logits = model(token[:, None], kv_cache=cache)[:, -1]
    return torch.stack(out, dim=1)
