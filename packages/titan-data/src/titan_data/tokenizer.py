"""Finding a tokenizer by name or path."""

from __future__ import annotations

import importlib.util
import os

from titan_data.byte_tokenizer import ByteTokenizer
from titan_data.hf_tokenizer import HFTokenizer, log_choices
from titan_data.llama3_tokenizer import Llama3Tokenizer

ACCEPTED = (
    "`byte` (no asset needed), `llama3` (the tokenizer.model shipped in the llama-models "
    "package), a path to a Hugging Face tokenizer.json or a tiktoken tokenizer.model, or a "
    "folder holding one (tokenizer.model, original/tokenizer.model or tokenizer.json)"
)


def llama3_package_asset() -> str:
    """Path of the tokenizer.model that the llama-models package ships."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "tokenizer `llama3` needs the llama-models package, which is not installed; "
            "run `pip install titan-llm-data[llama]` or pass a path to tokenizer.model"
        )
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "llama3", "tokenizer.model")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the installed llama-models package ({', '.join(spec.submodule_search_locations)}) "
        "has no llama3/tokenizer.model; reinstall it with `pip install titan-llm-data[llama]` "
        "or pass a path to tokenizer.model"
    )


def find_tokenizer_file(name_or_path: str) -> str:
    """The tokenizer file that `llama3` or a file/folder path names: a tiktoken
    tokenizer.model, or a Hugging Face tokenizer.json. A folder holding both is read through
    its tokenizer.model (Llama 3's downloads hold both, with the same ids)."""
    if name_or_path == "llama3":
        return llama3_package_asset()
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        tried = [
            os.path.join(path, "tokenizer.model"),
            os.path.join(path, "original", "tokenizer.model"),
            os.path.join(path, "tokenizer.json"),
        ]
        for candidate in tried:
            if os.path.isfile(candidate):
                return candidate
        raise FileNotFoundError(
            f"tokenizer folder {path} holds no tokenizer (looked for {', '.join(tried)}); "
            "download the model's assets there, or use " + ACCEPTED
        )
    if os.sep in path or path.endswith((".json", ".model")):
        raise FileNotFoundError(
            f"tokenizer path {path} does not exist; fix the path, or use {ACCEPTED}"
        )
    raise FileNotFoundError(
        f"unknown tokenizer {name_or_path!r}: it is neither a known name nor an existing "
        f"file or folder; use {ACCEPTED}"
    )


def find_tokenizer_model(name_or_path: str) -> str:
    """The tiktoken tokenizer.model file that `llama3` or a file/folder path names."""
    found = find_tokenizer_file(name_or_path)
    if is_tokenizer_json(found):
        raise FileNotFoundError(
            f"{found} is a Hugging Face tokenizer.json, not a tokenizer.model; "
            "load_tokenizer reads it"
        )
    return found


def is_tokenizer_json(path: str) -> bool:
    """Whether a tokenizer file is a Hugging Face tokenizer.json (JSON) rather than a
    tiktoken tokenizer.model (lines of base64 and a rank)."""
    if path.endswith(".json"):
        return True
    with open(path, "rb") as f:
        return f.read(64).lstrip().startswith(b"{")


def load_tokenizer(name_or_path: str) -> ByteTokenizer | Llama3Tokenizer | HFTokenizer:
    """Build the tokenizer named `name_or_path`: `byte`, `llama3`, a path to a Hugging Face
    tokenizer.json or a tiktoken tokenizer.model, or a folder holding one (see
    `find_tokenizer_file`)."""
    if name_or_path == "byte":
        return ByteTokenizer()
    path = find_tokenizer_file(name_or_path)
    if is_tokenizer_json(path):
        tokenizer = HFTokenizer(path)
        log_choices(tokenizer)
        return tokenizer
    return Llama3Tokenizer(path)
