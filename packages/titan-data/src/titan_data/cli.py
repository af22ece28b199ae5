"""The `titan-data` command: `titan-data tokenize` writes a source's token ids into shards once,
so that training reads them at memory speed; `titan-data info` describes such a folder.
`titan-data task-file` writes a split of a dataset already on this machine (the Hugging Face
cache, or a local folder or file) as an evaluation task's item file."""

from __future__ import annotations

import argparse
import json
import os
import sys

from titan_core.versions import add_version_flag
from titan_data.errors import DataError, MissingTextField


def _workers_default() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _parser() -> argparse.ArgumentParser:
    # The module docstring's first paragraph, whole: argparse rewraps it.
    about = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(prog="titan-data", description=about)
    add_version_flag(parser, "titan-data", "titan-llm-data")
    commands = parser.add_subparsers(dest="command", required=True)
    tok = commands.add_parser(
        "tokenize",
        help="tokenize a dataset into a folder of token shards (resumes an unfinished folder)",
        description="Tokenize DATASET once into OUT: token-id shards and an index that"
        " `--training.dataset OUT` trains from. Run the same command again to resume an"
        " interrupted run; it finishes with the same bytes an uninterrupted run writes.",
    )
    tok.add_argument(
        "--dataset", required=True, help="any form training.dataset takes (one dataset)"
    )
    tok.add_argument("--dataset-path", default=None, help="local copy of a hub dataset")
    tok.add_argument(
        "--tokenizer",
        required=True,
        help="byte, llama3, or a path to a Hugging Face tokenizer.json or a tiktoken"
        " tokenizer.model, or to a folder holding one",
    )
    tok.add_argument("--out", required=True, help="folder to write (created if needed)")
    tok.add_argument("--text-field", default="text", help="column holding the text (default text)")
    tok.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="tokens per shard, closed at the next document boundary (default 100,000,000)",
    )
    tok.add_argument(
        "--workers",
        type=int,
        default=_workers_default(),
        help="tokenizing processes (default: the CPUs this process may use)",
    )
    tok.add_argument(
        "--bad-rows",
        choices=("error", "skip"),
        default="error",
        help="a row that is not a text document stops the run (error, naming file and line) or"
        " is skipped and counted (skip)",
    )
    tok.add_argument(
        "--max-shards",
        type=int,
        default=None,
        help="stop after writing this many shards (run again to go on)",
    )
    tok.add_argument("--quiet", action="store_true", help="no progress bar")
    info = commands.add_parser("info", help="describe a folder of token shards")
    info.add_argument("folder")
    task = commands.add_parser(
        "task-file",
        help="write a split of a locally cached dataset as an evaluation task's item file",
        description="Write one split of DATASET (a Hugging Face dataset already in the local"
        " cache, or a local folder or file) to OUT (.jsonl or .parquet), for an [eval] task"
        " spec's `data`. Nothing is downloaded: a dataset the cache lacks is an error.",
    )
    task.add_argument("--dataset", required=True, help="hub name (owner/name) or local path")
    task.add_argument("--name", default=None, help="the dataset's configuration (subset)")
    task.add_argument("--split", required=True, help="the split to write (test, validation, ...)")
    task.add_argument("--out", required=True, help="the item file to write (.jsonl or .parquet)")
    task.add_argument("--limit", type=int, default=None, help="write only the first N rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "tokenize":
            return _tokenize(args)
        if args.command == "task-file":
            return _task_file(args)
        return _info(args.folder)
    except (DataError, ValueError, FileNotFoundError) as e:
        if isinstance(e, MissingTextField):
            e = e.for_option("--text-field")
        print(f"titan-data: error: {e}", file=sys.stderr)
        return 2


def _tokenize(args) -> int:
    from titan_data.pretokenize import tokenize_source

    manifest = tokenize_source(
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        tokenizer=args.tokenizer,
        out=args.out,
        text_field=args.text_field,
        shard_tokens=args.shard_tokens,
        workers=max(1, args.workers),
        bad_rows=args.bad_rows,
        max_shards=args.max_shards,
        progress=not args.quiet,
    )
    done = "wrote" if manifest["complete"] else "stopped after"
    skipped = f", skipped {manifest['skipped_rows']:,} bad rows" if manifest["skipped_rows"] else ""
    print(
        f"titan-data: {done} {len(manifest['shards'])} shards, {manifest['documents']:,} documents,"
        f" {manifest['tokens']:,} tokens in {args.out}{skipped}"
        + ("" if manifest["complete"] else "; run the same command again to go on")
    )
    return 0


def _task_file(args) -> int:
    from titan_data.eval_tasks import write_task_file

    n = write_task_file(args.dataset, args.split, args.out, name=args.name, limit=args.limit)
    print(f"titan-data: wrote {n:,} items of {args.dataset} ({args.split}) to {args.out}")
    return 0


def _info(folder: str) -> int:
    from titan_data.token_shards import TokenShards

    shards = TokenShards(folder)
    shards.check()
    m = shards.manifest
    print(shards.description)
    print(json.dumps({k: m[k] for k in ("tokenizer", "source", "dtype", "skipped_rows")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
