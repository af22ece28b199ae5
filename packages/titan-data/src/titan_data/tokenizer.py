"""Finding a tokenizer by name or path."""

from __future__ import annotations

import importlib.util
import os

from titan_data.byte_tokenizer import ByteTokenizer
from titan_data.llama3_tokenizer import Llama3Tokenizer

ACCEPTED = (
    "`byte` (no asset needed), `llama3` (the tokenizer.model shipped in the llama-models "
    "package), a path to a tokenizer.model file, or a folder holding tokenizer.model or "
    "original/tokenizer.model"
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


def find_tokenizer_model(name_or_path: str) -> str:
    """The tokenizer.model file that `llama3` or a file/folder path names."""
    if name_or_path == "llama3":
        return llama3_package_asset()
    path = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        tried = [
            os.path.join(path, "tokenizer.model"),
            os.path.join(path, "original", "tokenizer.model"),
        ]
        for candidate in tried:
            if os.path.isfile(candidate):
                return candidate
        raise FileNotFoundError(
            f"tokenizer folder {path} holds no tokenizer.model (looked for {' and '.join(tried)}); "
            "download the model's assets there, or use " + ACCEPTED
        )
    raise FileNotFoundError(
        f"unknown tokenizer {name_or_path!r}: it is neither a known name nor an existing "
        f"file or folder; use {ACCEPTED}"
    )


def load_tokenizer(name_or_path: str) -> ByteTokenizer | Llama3Tokenizer:
    """Build the tokenizer named `name_or_path`: `byte`, `llama3`, or a path to tokenizer.model
    or to a folder holding it (directly or under `original/`)."""
    if name_or_path == "byte":
        return ByteTokenizer()
    return Llama3Tokenizer(find_tokenizer_model(name_or_path))
