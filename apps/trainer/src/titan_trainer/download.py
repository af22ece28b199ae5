"""`titan-download`: a model's Hugging Face assets where the configs look for them.

    titan-download meta-llama/Llama-3.1-8B                      # tokenizer files
    titan-download meta-llama/Llama-3.1-8B --assets tokenizer weights
    titan-train --job.config_file llama3_8b --model.hf_assets_path assets/hf/Llama-3.1-8B

Files come through huggingface_hub into its cache (HF_HOME / HF_HUB_CACHE; already cached
files are not fetched again, and with HF_HUB_OFFLINE=1 only the cache is read), then are placed
in `--local-dir` (default `assets/hf/<name>`, torchtitan's layout), linked when the cache is on
the same disk, else copied. The token is `--token`, else HF_TOKEN or the one `hf auth login`
saved. Progress: huggingface_hub's bars while downloading, then one for placing the files (on
stderr; HF_HUB_DISABLE_PROGRESS_BARS=1 turns both off).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from titan_trainer.hf_assets import ASSETS, DownloadError
from titan_trainer.tools import run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("titan-download", __doc__)
    parser.add_argument("repo_id", help="a Hugging Face model repo, e.g. meta-llama/Llama-3.1-8B")
    parser.add_argument(
        "--assets",
        nargs="+",
        choices=sorted(ASSETS),
        default=["tokenizer"],
        help="what to fetch (default: tokenizer)",
    )
    parser.add_argument(
        "--local-dir", default=None, help="where to put the files (default: assets/hf/<name>)"
    )
    parser.add_argument(
        "--token", default=None, help="Hugging Face token (default: HF_TOKEN, or the saved login)"
    )
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # huggingface_hub loads once the flags are read: `--help` and a bad flag answer at once.
    from titan_trainer.download_hub import download

    return run_tool("titan-download", download, a, (DownloadError,), 1)


if __name__ == "__main__":
    sys.exit(main())
