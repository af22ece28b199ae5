"""A Titan tokenizer written as the files a Hugging Face model folder keeps beside its weights
(`tokenizer.json`, `tokenizer_config.json`), so that `transformers.AutoTokenizer` (and so
lm-evaluation-harness, vLLM, ...) encodes text to the ids Titan trained on.

- `byte`: a byte-level BPE with no merges, whose 256 tokens are the UTF-8 bytes at ids 0..255,
  then `<bos>`, `<eos>`, `<pad>` at 256..258: the same ids as `ByteTokenizer`.
- a `tokenizer.json` tokenizer (`HFTokenizer`): its file and the config files beside it, copied.
- Llama 3's `tokenizer.model` (`Llama3Tokenizer`): the file, under `original/` as Meta's
  releases keep it, and a `tokenizer.json` converted from it by `transformers`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from titan_data.byte_tokenizer import ByteTokenizer
from titan_data.hf_tokenizer import HFTokenizer

BYTE_SPECIALS = ("<|titan_byte_bos|>", "<|titan_byte_eos|>", "<|titan_byte_pad|>")
"""The names `ByteTokenizer`'s BOS, EOS and PAD (ids 256, 257, 258) get in `tokenizer.json`.
`ByteTokenizer` encodes any text as its bytes, while `transformers` reads a special token's
name in text as the token: names no real text holds keep the two equal."""


def write_hf_tokenizer(tokenizer, folder: str | os.PathLike) -> list[str]:
    """Write `tokenizer` into `folder` as Hugging Face tokenizer files; returns the names
    written. Raises ValueError for a tokenizer it cannot write, naming it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, ByteTokenizer):
        return _write_byte(folder)
    if isinstance(tokenizer, HFTokenizer):
        return _copy_beside(Path(tokenizer.model_path), folder)
    model_path = getattr(tokenizer, "model_path", None)
    if model_path is not None and type(tokenizer).__name__ == "Llama3Tokenizer":
        return _write_llama3(tokenizer, Path(model_path), folder)
    raise ValueError(
        f"cannot write {tokenizer!r} as Hugging Face tokenizer files; use the `byte` tokenizer,"
        " a tokenizer.json or Llama 3's tokenizer.model"
    )


def byte_tokenizer_json():
    """`ByteTokenizer` as a `tokenizers.Tokenizer`: each byte one token, ids as Titan's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to a printable character; with no merges, BPE then gives one
    # token per byte, whose id is the byte's value.
    alphabet = ByteLevel.alphabet()
    by_byte = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(by_byte.values())
    vocab = {by_byte[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in BYTE_SPECIALS])
    ids = [tok.token_to_id(name) for name in BYTE_SPECIALS]
    byte = ByteTokenizer()
    assert ids == [byte.bos_id, byte.eos_id, byte.pad_id], ids
    # `add_special_tokens=True` starts a text with BOS, as Titan's documents start.
    bos = BYTE_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, byte.bos_id)]
    )
    return tok


def _write_byte(folder: Path) -> list[str]:
    byte_tokenizer_json().save(str(folder / "tokenizer.json"))
    bos, eos, pad = BYTE_SPECIALS
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": True,
        "model_max_length": 1_000_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def _copy_beside(path: Path, folder: Path) -> list[str]:
    written = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = path if name == "tokenizer.json" else path.parent / name
        if source.is_file() and source.resolve() != (folder / name).resolve():
            shutil.copyfile(source, folder / name)
            written.append(name)
    return written


def _write_llama3(tokenizer, path: Path, folder: Path) -> list[str]:
    (folder / "original").mkdir(exist_ok=True)
    shutil.copyfile(path, folder / "original" / "tokenizer.model")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    names = sorted(tokenizer.special_tokens, key=tokenizer.special_tokens.get)
    converted = TikTokenConverter(
        vocab_file=str(path),
        pattern=tokenizer._encoding._pat_str,
        extra_special_tokens=names,
    ).converted()
    converted.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|finetune_right_pad_id|>",
        "add_bos_token": True,
        "model_max_length": 1_000_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["original/tokenizer.model", "tokenizer.json", "tokenizer_config.json"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizes to)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))
