"""Hugging Face tokenizers: a `tokenizer.json` read by the `tokenizers` library, with its special
tokens taken from the files a model's folder keeps beside it.

Which token is BOS, EOS and PAD is not in `tokenizer.json` itself. It is read, in this order,
from `tokenizer_config.json` (`bos_token`, `eos_token`, `pad_token`, as a string or as
`{"content": ...}`), `special_tokens_map.json` (the same keys) and `config.json`
(`bos_token_id`, `eos_token_id`, `pad_token_id`); failing those, from the names the families
use for them among the tokenizer's special tokens. A token that `tokenizer_config.json` names
but `tokenizer.json` lacks is added as a special token with the next free id, as `transformers`
does. `load_tokenizer` logs once per file what was chosen and where it came from.

Documents are packed as `BOS + text + EOS`. A tokenizer without a BOS of its own (Qwen's; or one
whose BOS is its EOS, GPT-2's; or `add_bos_token: false`) adds none: documents are `text + EOS`,
and `bos_id` is the EOS id, since the EOS that ends a document is the token that starts the
next one (what block-causal attention needs to find the document boundaries).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer

from titan_core.messages import first_line

log = logging.getLogger("titan.data")  # titan_core's logger, without importing torch here

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "config.json")

# The names the families give their special tokens, for a tokenizer.json without config files.
KNOWN_NAMES = {
    "bos": ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<bos>", "<|startoftext|>"),
    "eos": (
        "<|end_of_text|>",
        "<|endoftext|>",
        "<｜end▁of▁sentence｜>",
        "</s>",
        "<eos>",
        "<|eos|>",
    ),
    "pad": ("<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]", "<｜▁pad▁｜>"),
}

_DESCRIBED: set[str] = set()  # tokenizer.json files whose choices were logged in this process


@dataclass(frozen=True)
class Special:
    """One role's token: its text, id, and which file named it (or how it was chosen)."""

    name: str
    id: int
    source: str


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library.

    `encode` gives the ids `tokenizers` gives for the text without its post-processor's
    template (`add_special_tokens=False`), with BOS/EOS added as asked. Text that looks like a
    special token (`"<|endoftext|>"`) is encoded as ordinary text, as with the other Titan
    tokenizers, so documents cannot inject control tokens.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        self.model_path = path
        self._tokenizer = read_tokenizer_json(path)
        folder = os.path.dirname(os.path.abspath(path))
        configs = {name: read_json_beside(folder, name) for name in CONFIG_FILES}
        self.added = _add_named_tokens(self._tokenizer, configs)
        # Special-token text in a document stays text (tokenizers >= 0.15 has the switch).
        self._tokenizer.encode_special_tokens = True
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1
        self.special_tokens: dict[str, int] = {
            t.content: i
            for i, t in sorted(self._tokenizer.get_added_tokens_decoder().items())
            if t.special
        }
        eos = self._special("eos", configs)
        if eos is None:
            raise ValueError(
                f"{path}: no end-of-document token: none of {', '.join(CONFIG_FILES)} beside it "
                f"names eos_token, and it has none of {', '.join(KNOWN_NAMES['eos'])}; add "
                '`"eos_token": "<name of the token>"` to tokenizer_config.json beside it'
            )
        bos = self._special("bos", configs)
        self.adds_bos: bool = bos is not None and bos.id != eos.id and _adds_bos(configs)
        pad = self._special("pad", configs)
        self.eos_id: int = eos.id
        self.bos_id: int = bos.id if self.adds_bos else eos.id
        self.pad_id: int = pad.id if pad is not None else eos.id
        self.description = _describe(path, self, bos, eos, pad, configs)

    def _special(self, role: str, configs: dict[str, dict[str, Any] | None]) -> Special | None:
        """The token that plays `role` (bos, eos, pad), from the config files, else by name."""
        for file in ("tokenizer_config.json", "special_tokens_map.json"):
            config = configs[file]
            if config is not None and f"{role}_token" in config:
                name = _token_text(config[f"{role}_token"], file, role)
                if name is None:  # an explicit null: this tokenizer has none
                    return None
                # Present: _add_named_tokens added every token a config file names.
                return Special(name, self._tokenizer.token_to_id(name), file)
        config = configs["config.json"]
        if config is not None and config.get(f"{role}_token_id") is not None:
            value = config[f"{role}_token_id"]
            token_id = value[0] if isinstance(value, list) and value else value
            if isinstance(token_id, int) and 0 <= token_id < self.vocab_size:
                return Special(str(self._tokenizer.id_to_token(token_id)), token_id, "config.json")
        for name in KNOWN_NAMES[role]:
            if name in self.special_tokens:
                return Special(name, self.special_tokens[name], "by its name")
        return None

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos and self.adds_bos else []
        ids.extend(self._tokenizer.encode(text, add_special_tokens=False).ids)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A worker process started by spawn gets a pickled copy; tokenizers does not pickle the
        # switch, and special-token text would become control tokens there.
        self.__dict__.update(state)
        self._tokenizer.encode_special_tokens = True

    def __repr__(self) -> str:
        return f"HFTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def read_tokenizer_json(path: str) -> Tokenizer:
    """`tokenizers`' Tokenizer of the file, or a ValueError naming the file and the fix."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception for any unreadable file
        raise ValueError(
            f"{path} is not a tokenizer.json the tokenizers library can read ({first_line(e)}); "
            "download it again with the model's other assets, or point tokenizer_path at "
            "another tokenizer"
        ) from None


def read_json_beside(folder: str, name: str) -> dict[str, Any] | None:
    """A config file of the tokenizer's folder, None when there is none."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it names the tokenizer's special tokens: "
            "download it again, or remove it to choose them from the tokenizer alone"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object; fix it")
    return config


def _token_text(value: Any, file: str, role: str) -> str | None:
    """A special token as the config files write it: a string, `{"content": ...}` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f'{file}: {role}_token is {value!r}; write the token\'s text, e.g. "</s>"')


def _add_named_tokens(tokenizer: Tokenizer, configs: dict[str, dict[str, Any] | None]) -> list[str]:
    """Add the special tokens the config files name (bos/eos/pad/unk, and the
    added_tokens_decoder of tokenizer_config.json) that the tokenizer lacks, in that order, as
    `transformers` does; returns their names."""
    named: list[tuple[str, dict[str, Any]]] = []
    for role in ("bos", "eos", "pad", "unk"):
        for file in ("tokenizer_config.json", "special_tokens_map.json"):
            config = configs[file]
            if config is not None and f"{role}_token" in config:
                value = config[f"{role}_token"]
                text = _token_text(value, file, role)
                if text is not None:
                    named.append((text, value if isinstance(value, dict) else {}))
                break
    decoder = (configs["tokenizer_config.json"] or {}).get("added_tokens_decoder") or {}
    for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if isinstance(entry, dict) and isinstance(entry.get("content"), str):
            named.append((entry["content"], entry))
    missing: dict[str, AddedToken] = {}
    for text, options in named:
        if tokenizer.token_to_id(text) is None and text not in missing:
            missing[text] = AddedToken(
                text,
                single_word=options.get("single_word", False),
                lstrip=options.get("lstrip", False),
                rstrip=options.get("rstrip", False),
                normalized=options.get("normalized", False),
                special=options.get("special", True),
            )
    if missing:
        tokenizer.add_special_tokens(list(missing.values()))
    return list(missing)


def _adds_bos(configs: dict[str, dict[str, Any] | None]) -> bool:
    config = configs["tokenizer_config.json"] or {}
    return config.get("add_bos_token") is not False


def _describe(
    path: str,
    tok: HFTokenizer,
    bos: Special | None,
    eos: Special,
    pad: Special | None,
    configs: dict[str, dict[str, Any] | None],
) -> str:
    def one(role: str, special: Special | None) -> str:
        if special is None:
            return f"{role} none"
        added = " (added: not in tokenizer.json)" if special.name in tok.added else ""
        return f"{role} {special.name} = {special.id} ({special.source}){added}"

    if tok.adds_bos:
        start = one("BOS", bos)
    else:
        why = (
            "it has none"
            if bos is None
            else "add_bos_token is false"
            if not _adds_bos(configs)
            else "its BOS is its EOS"
        )
        start = f"no BOS ({why}): documents are text + EOS"
    pad_text = one("PAD", pad) if pad is not None else f"PAD = EOS {eos.id} (none named)"
    return f"{path}: {tok.vocab_size:,} ids; {start}; {one('EOS', eos)}; {pad_text}"


def log_choices(tokenizer: HFTokenizer) -> None:
    """Log once per file in this process which special tokens were chosen."""
    if tokenizer.model_path not in _DESCRIBED:
        _DESCRIBED.add(tokenizer.model_path)
        log.info("tokenizer: %s", tokenizer.description)
