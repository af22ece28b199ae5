"""The Llama 3 tokenizer: tiktoken BPE over 128,000 ranks plus 256 special tokens."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import tiktoken
from tiktoken.load import load_tiktoken_bpe

# Llama 3's pre-tokenizer: contractions, letter runs, up to three digits, punctuation runs,
# newlines and other whitespace.
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)

# tiktoken's Rust encoder can overflow its stack on very long inputs and goes quadratic on
# very long runs of one character class, so text is cut into pieces first. The cut points
# are the ones Meta's reference tokenizer uses, so ids match it exactly.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(
    rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}"
)  # the lookbehinds start a match only at the beginning of a run, which keeps the scan linear


def special_token_names() -> list[str]:
    """The 256 special tokens in id order (ids 128000.. for the official vocabulary)."""
    reserved = NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS)
    return list(_NAMED_SPECIAL_TOKENS) + [
        f"<|reserved_special_token_{2 + i}|>" for i in range(reserved)
    ]


def split_for_tiktoken(text: str) -> Iterator[str]:
    """Pieces of `text`, in order, none longer than MAX_ENCODE_CHARS and none holding a run
    of more than MAX_RUN_CHARS whitespace or non-whitespace characters."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        cut = 0
        if len(chunk) > MAX_RUN_CHARS:
            for run in _LONG_RUN.finditer(chunk):
                for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                    yield chunk[cut:pos]
                    cut = pos
        yield chunk[cut:]


class Llama3Tokenizer:
    """Meta's Llama 3 tokenizer, read from a `tokenizer.model` file.

    `encode` treats text that looks like a special token (`"<|eot_id|>"`) as ordinary
    text, so documents cannot inject control tokens; only `bos`/`eos` add special ids.
    """

    def __init__(self, model_path: str | os.PathLike):
        model_path = os.fspath(model_path)
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"Llama 3 tokenizer file not found: {model_path}")
        ranks = load_tiktoken_bpe(model_path)
        self.model_path = model_path
        self.special_tokens = {name: len(ranks) + i for i, name in enumerate(special_token_names())}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(model_path),
            pat_str=PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size: int = len(ranks) + NUM_SPECIAL_TOKENS
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.eot_id: int = self.special_tokens["<|eot_id|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad_id|>"]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        for piece in split_for_tiktoken(text):
            ids.extend(self._encoding.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"Llama3Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"
