"""A tokenizer that needs no asset: UTF-8 bytes plus three special ids."""

from __future__ import annotations


class ByteTokenizer:
    """Token ids 0..255 are the UTF-8 bytes of the text; 256 is BOS, 257 EOS, 258 PAD.

    Any string round-trips (`decode(encode(s)) == s`), and special-token-looking text is
    just bytes. Useful for debug runs and tests with a tiny embedding table.
    """

    vocab_size: int = 259
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        ids.extend(text.encode("utf-8"))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        # Special ids carry no text; a window cut mid-character decodes with U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
