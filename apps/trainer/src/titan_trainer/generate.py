"""`titan-generate`: text from a trained model, with a KV cache.

    titan-generate outputs/debug --prompt "The list type" --max-new-tokens 120
    titan-generate hf_out --tokenizer byte --prompt "def " --temperature 0.8 --top-p 0.9
    torchrun --nproc_per_node 2 -m titan_trainer.generate outputs/debug --prompt "The"

The weights come from a DCP checkpoint in any layout (a `step-N` folder, a checkpoint folder
or a run's dump folder: the newest complete checkpoint), read through titan-ckpt, with the
model, flavor, sequence length and tokenizer of the run's config saved beside it; or from a
Hugging Face folder (`config.json` + safetensors; the flavor whose shapes match is found). The
tokens are the run's tokenizer's (`--tokenizer` for a Hugging Face folder without one).

Under torchrun the model is split with tensor parallel over every process (no sequence
parallel: one new token at a time); each rank reads the full weights and keeps its shard, and
every rank draws the same tokens (the same seed); rank 0 prints.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence

from titan_trainer.tools import run_tool, tool_parser


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser("titan-generate", __doc__)
    parser.add_argument(
        "source",
        help="a DCP checkpoint, checkpoint folder or dump folder; or a Hugging Face folder",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: from the start)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=100, help="tokens to generate at most"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); above 0: sample"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample among the k most likely tokens"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample among the most likely tokens that make up p",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument(
        "--samples", type=int, default=1, help="continuations to generate (a batch)"
    )
    parser.add_argument(
        "--no-stop",
        dest="stop_at_eos",
        action="store_false",
        help="do not stop at the end-of-text token",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer name or path (default: the run's; for a Hugging Face folder, the folder)",
    )
    parser.add_argument(
        "--model",
        default="llama3",
        help="model family of a Hugging Face folder (titan.models name)",
    )
    parser.add_argument(
        "--flavor",
        default=None,
        help="flavor of a Hugging Face folder (default: the one whose shapes match)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype"
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to compute"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.max_new_tokens < 1 or a.samples < 1:
        print(
            "titan-generate: error: --max-new-tokens and --samples take 1 or more", file=sys.stderr
        )
        return 2
    # The model, torch and the checkpoints load once the flags are read: `--help`, `--version`
    # and a bad flag answer at once.
    from titan_trainer.checkpointing.reading import UnusableCheckpoint
    from titan_trainer.generate_run import run
    from titan_trainer.generate_source import GenerateError

    errors = (
        GenerateError,
        UnusableCheckpoint,
        FileNotFoundError,
        ValueError,
        tomllib.TOMLDecodeError,
    )
    return run_tool("titan-generate", run, a, errors, 2)


if __name__ == "__main__":
    sys.exit(main())
