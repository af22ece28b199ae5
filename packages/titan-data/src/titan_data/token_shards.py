"""Pre-tokenized data: a folder of token-id shards that `titan-data tokenize` writes, and the
reader that trains from it by memory map.

The folder holds:
- `titan-tokens.json`, the index: format version, the tokenizer that made the ids (its
  vocabulary size, BOS/EOS ids and a fingerprint of its model file), the source, and one entry
  per shard (its file, documents, tokens, largest id, and where the source reader stood after
  its last document, from which an interrupted `tokenize` resumes);
- `shard-NNNNN.bin`: the shard's ids, little-endian `uint16` when the vocabulary fits, else
  `uint32`; documents one after another, each `BOS + tokens + EOS`, exactly as the loader
  packs raw text;
- `shard-NNNNN.docs.npy`: int64 offsets of each document's first token in the shard, and the
  shard's length at the end.

Training reads the shards as one token stream cut into windows of `seq_len + 1` tokens (so
documents are packed across the whole source, not per stream), visits the windows of each
epoch in an order drawn from (seed, epoch) and reads each with one slice of a memory map:
sample `c` of the source is a pure function of `c`, which makes it layout-independent and
needs no per-rank state.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from functools import cached_property
from typing import Any

import numpy as np

from titan_data.errors import DataError

MANIFEST = "titan-tokens.json"
FORMAT = "titan-tokens"
VERSION = 1
MASK64 = (1 << 64) - 1


def is_token_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What identifies a tokenizer's ids: the SHA-256 of its model file when it has one, else
    its class and vocabulary size."""
    path = getattr(tokenizer, "model_path", None)
    if path and os.path.isfile(path):
        return "sha256:" + _file_sha256(path, os.path.getsize(path), os.path.getmtime(path))
    return f"{type(tokenizer).__name__}:{tokenizer.vocab_size}"


_HASHES: dict[tuple, str] = {}


def _file_sha256(path: str, size: int, mtime: float) -> str:
    key = (path, size, mtime)
    if key not in _HASHES:
        with open(path, "rb") as f:
            _HASHES[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _HASHES[key]


def tokenizer_record(tokenizer: Any, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }


def differences(
    made: dict[str, Any], now: dict[str, Any], keys: Iterable[str], label: str
) -> list[str]:
    """`key <made> (<label> <now>)` for each of `keys` whose value differs between a record
    written earlier and the same record made now."""
    return [
        f"{key} {made.get(key)!r} ({label} {now[key]!r})"
        for key in keys
        if made.get(key) != now[key]
    ]


def read_manifest(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: not a valid index (malformed JSON at line {e.lineno}); run `titan-data"
            " tokenize` again with the same arguments to rewrite it"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a titan-tokens index (no format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise DataError(
            f"{path}: index version {manifest.get('version')!r}; this titan-data reads version"
            f" {VERSION}; tokenize the source again with this version"
        )
    return manifest


def write_manifest(folder: str, manifest: dict[str, Any]) -> None:
    """Replace the index atomically: a reader sees the old one or the new one, never half."""
    path = os.path.join(folder, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class TokenShards:
    """The token stream of a folder written by `titan-data tokenize`, as windows."""

    def __init__(self, folder: str):
        self.folder = os.path.expanduser(folder)
        self.manifest = read_manifest(self.folder)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards = self.manifest["shards"]
        sizes = [int(s["tokens"]) for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.tokens = int(self.starts[-1])
        self.documents = sum(int(s["documents"]) for s in self.shards)
        self.name = folder
        tok = self.manifest["tokenizer"]
        self.description = (
            f"{self.documents:,} documents, {self.tokens:,} tokens in {len(self.shards)}"
            f" shard{'s' if len(self.shards) != 1 else ''}, tokenized with {tok['name']}"
            f" ({self.folder})"
        )

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """The index is complete and every shard has the size it records."""
        where = os.path.join(self.folder, MANIFEST)
        if not self.manifest.get("complete"):
            raise DataError(
                f"{where}: tokenization did not finish ({len(self.shards)} shards written);"
                " run the same `titan-data tokenize` command again to resume it"
            )
        if self.tokens == 0:
            raise DataError(f"{where}: holds no tokens; tokenize a source with text")
        for shard in self.shards:
            path = os.path.join(self.folder, shard["file"])
            expected = int(shard["tokens"]) * self.dtype.itemsize
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != expected:
                found = "is missing" if size is None else f"holds {size:,} bytes"
                raise DataError(
                    f"{path} {found}, the index says {int(shard['tokens']):,} tokens"
                    f" ({expected:,} bytes): the shard is truncated or was changed; run"
                    " `titan-data tokenize` again with the same arguments into a new folder"
                )

    def check_tokenizer(self, tokenizer: Any) -> None:
        """The ids were made by this tokenizer (same vocabulary, BOS, EOS and model file)."""
        made = self.manifest["tokenizer"]
        now = tokenizer_record(tokenizer, "")
        different = differences(
            made, now, ("vocab_size", "bos_id", "eos_id", "fingerprint"), "this run:"
        )
        if different:
            raise DataError(
                f"{self.folder} was tokenized with {made['name']}, which differs from this run's"
                f" tokenizer: {', '.join(different)}\ntrain with that tokenizer, or tokenize the"
                " source again with this one"
            )

    # ------------------------------------------------------------------ windows

    def windows(self, seq_len: int) -> int:
        """Windows of `seq_len + 1` tokens in one pass over the stream."""
        return self.tokens // (seq_len + 1)

    @cached_property
    def _maps(self) -> list[np.memmap]:
        return [
            np.memmap(os.path.join(self.folder, s["file"]), dtype=self.dtype, mode="r")
            for s in self.shards
        ]

    def window(self, index: int, seq_len: int, seed: int) -> tuple[np.ndarray, int]:
        """(window of sample `index` of this source as int64 `[seq_len + 1]`, its epoch):
        epoch `index // windows`, at the place a permutation of (seed, epoch) gives it."""
        count = self.windows(seq_len)
        epoch, position = divmod(index, count)
        start = shuffled(position, count, seed, epoch) * (seq_len + 1)
        window = self.read(start, seq_len + 1)
        return window, epoch

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, as int64, across shard boundaries."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts, shard, pos = [], first, start
        while length > 0:
            offset = pos - int(self.starts[shard])
            take = min(length, int(self.starts[shard + 1]) - pos)
            parts.append(self._maps[shard][offset : offset + take])
            pos, length, shard = pos + take, length - take, shard + 1
        window = np.concatenate(parts).astype(np.int64)
        vocab = int(self.manifest["tokenizer"]["vocab_size"])
        if window.size and int(window.max()) >= vocab:
            bad = int(np.argmax(window >= vocab))
            where, _ = self._locate(start + bad)
            raise DataError(
                f"{where}: token id {int(window[bad])} is not below the vocabulary size {vocab}:"
                " the shard is corrupt; tokenize the source again into a new folder"
            )
        return window

    def _locate(self, position: int) -> tuple[str, int]:
        shard = int(np.searchsorted(self.starts, position, side="right")) - 1
        offset = position - int(self.starts[shard])
        path = os.path.join(self.folder, self.shards[shard]["file"])
        return f"{path} token {offset}", offset

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_maps", None)  # memory maps reopen in the process that unpickles this
        return state


# ----------------------------------------------------------------------------- the order


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def shuffled(position: int, count: int, seed: int, epoch: int) -> int:
    """Where `position` of `count` goes in the permutation of (seed, epoch): a four-round
    Feistel network over the smallest even power of two >= count, walked until it lands
    below count. A bijection of [0, count) computed in O(1) memory, so the order of a
    trillion-token source needs no table."""
    if count <= 1:
        return 0
    half = max(1, ((count - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [_mix(_mix(_mix(seed & MASK64) ^ epoch) ^ r) for r in range(4)]
    x = position
    while True:
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        x = (left << half) | right
        if x < count:
            return x
