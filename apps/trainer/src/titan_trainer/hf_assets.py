"""The Hugging Face assets `titan-download` fetches, by kind, and the error it says, shared by
its command line (`titan_trainer.download`) and its work (`titan_trainer.download_hub`)."""

from __future__ import annotations

ASSETS = {
    "tokenizer": [
        "tokenizer.model",
        "original/tokenizer.model",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "config.json",
        "generation_config.json",
    ],
    "weights": ["*.safetensors", "model.safetensors.index.json", "config.json"],
}
"""What each kind of asset is, as file patterns of the repo."""


class DownloadError(Exception):
    pass
